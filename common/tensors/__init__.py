"""Weight sync's torch side, shared by the learner and the rollout server: weight names, manifest and digests
(``weights.py``), packed buckets (``packed.py``) and the ``ipc`` transport's shared buffers (``shared.py``)."""
