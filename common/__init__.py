"""What the processes share, one subpackage per concept: ``config/``, ``wire/``, ``detection/``, ``evaluation/``,
``packing/``, ``data/``, ``runs/``; torch code in ``tensors/`` (weight sync), ``generation/``, ``distributed/``.
No module lives here and none re-exports another's names (docs/architecture.md, tests/test_layout.py)."""
