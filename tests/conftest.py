"""Session fixtures shared by the test suite.

Artifacts are built into ``<repo>/artifacts/`` (git-ignored) and reused across sessions: the builders
are deterministic and skip work when the directory already holds a build with the same parameters,
so the first session pays a few seconds and later ones nothing. Concurrent sessions are safe (each
builder renames a private folder into place).
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO_ROOT / "artifacts"


@pytest.fixture(scope="session")
def synth_data_dir() -> Path:
    """``artifacts/data/synth-test``: train.jsonl (56 records), val.jsonl (8), images/; seed 0.

    Not ``artifacts/data/synth``: ``make data`` writes a bigger set there for the demo, and two
    parameter sets in one folder would regenerate it under each other's feet.
    """
    from common.synthetic import ensure_synthetic_data

    return ensure_synthetic_data(ARTIFACTS / "data" / "synth-test", n=64, seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """``artifacts/tiny-model``: the tiny Qwen2.5-VL with coord tokens (tools/make_tiny_model.py)."""
    from tools.make_tiny_model import ensure_tiny_model

    return ensure_tiny_model(ARTIFACTS / "tiny-model")
