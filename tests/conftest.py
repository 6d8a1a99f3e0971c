"""Session fixtures shared by the test suite.

Artifacts are built into ``<repo>/artifacts/`` (git-ignored) and reused across sessions: the builders
are deterministic and skip work when the directory already holds a build with the same parameters,
so the first session pays a few seconds and later ones nothing. Concurrent sessions and parallel test
workers are safe (each builder renames a private folder into place; the minutes-long detector build
runs under a lock, so it runs once).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
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


#: The test detector's build: 1 shape per image (4096 images), 2200 warm-start steps, ~2.5 min on 2 cores
#: (docs/warm_start.md). Cheaper than the demo's (3 shapes, 2500 longer steps, ~4.5 min), and a sharper
#: detector: most validation boxes match at IoU >= 0.5.
TEST_DETECTOR_DATA = dict(split=(4096, 16), seed=1, sides=(112,), max_objects=1, size_range=(0.25, 0.6))
TEST_DETECTOR_OVERRIDES = ["training.max_steps=2200", "training.log_every_steps=200", "training.progress=false"]


@pytest.fixture(scope="session")
def detector_data_dir() -> Path:
    """``artifacts/data/detect1-test``: what the test detector trains on (val.jsonl: 16 held-out images)."""
    from common.synthetic import generate

    return generate(ARTIFACTS / "data" / "detect1-test", **TEST_DETECTOR_DATA).parent


@pytest.fixture(scope="session")
def tiny_detector_dir(tiny_model_dir: Path, detector_data_dir: Path) -> Path:
    """``artifacts/tiny-detector-test``: the tiny model after a Stage-1 warm start (learner/warm_start.py)
    on ``detector_data_dir``; built once, cached by its build parameters."""
    from common.config import load_config
    from learner.warm_start import ensure_warm_start

    data = detector_data_dir
    cfg = load_config(REPO_ROOT / "configs" / "warm_start_cpu.yaml", [
        f"model.path={tiny_model_dir}", f"data.train_jsonl={data / 'train.jsonl'}",
        f"data.val_jsonl={data / 'val.jsonl'}", *TEST_DETECTOR_OVERRIDES], world_size=1)
    with build_lock(ARTIFACTS / ".tiny-detector-test.lock"):  # pytest-xdist workers: one builds, the others wait
        path, _ = ensure_warm_start(cfg, ARTIFACTS / "tiny-detector-test")
    return path


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """An exclusive lock file across processes (fcntl): a build the parallel test workers share runs once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield
