"""Small synthetic objects for tests: valid by their own contract, deterministic, numpy only."""

from __future__ import annotations

import zlib

import numpy as np

from common.packing.segment import IGNORE_INDEX, Segment

PATCH_DIM = 8  # pixel_values row width of factory images (real Qwen2-VL: 1176)
#: scale, offset per column: (u8 / 255 - 0.5) / 0.5, the Qwen3-VL processor's normalisation
PIXEL_AFFINE = np.array([[2 / 255] * PATCH_DIM, [-1.0] * PATCH_DIM], np.float32)
GRID_THW = (1, 2, 2)  # every factory image is 4 patches


def make_segment(
    length: int,
    ver: int,
    sample_id: str | None = None,
    n_images: int = 0,
    channel: str = "B",
    mrope: bool = True,
) -> Segment:
    """A valid segment of ``length`` tokens; its content is a pure function of the arguments.

    Boxes: ``min(2, (length - 1) // 4)`` coord groups after position 0. Images: ``n_images`` of
    ``GRID_THW`` patches of width ``PATCH_DIM``. Position ids restart at 0, 3 rows if ``mrope``.
    """
    if length < 1:
        raise ValueError("a segment has at least one token")
    sample_id = sample_id if sample_id is not None else f"s{length}-v{ver}"
    rng = np.random.default_rng(zlib.crc32(f"{sample_id}/{length}/{ver}/{n_images}".encode()))
    input_ids = rng.integers(0, 150_000, size=length, dtype=np.int64)
    labels = input_ids.copy()  # labels[p] is predicted from the logits at p - 1
    labels[0] = IGNORE_INDEX
    weights = (labels != IGNORE_INDEX).astype(np.float32)
    n_coord = 4 * min(2, (length - 1) // 4)
    coord_pos = np.sort(rng.choice(np.arange(1, length), size=n_coord, replace=False)).astype(np.int64)
    labels[coord_pos] = IGNORE_INDEX
    weights[coord_pos] = 0.0
    rows = 3 if mrope else 1
    patches = n_images * int(np.prod(GRID_THW))
    segment = Segment(
        sample_id=sample_id,
        channel=channel,
        ver=ver,
        input_ids=input_ids,
        labels=labels,
        weights=weights,
        position_ids=np.tile(np.arange(length, dtype=np.int64), (rows, 1)),
        coord_pos=coord_pos,
        coord_bins=rng.integers(0, 1000, size=n_coord, dtype=np.int64),
        pixel_values=rng.integers(0, 256, size=(patches, PATCH_DIM), dtype=np.uint8),
        image_grid_thw=np.array([GRID_THW] * n_images, dtype=np.int64).reshape(n_images, 3),
        pixel_affine=PIXEL_AFFINE.copy() if n_images else np.zeros((2, 0), np.float32),
        meta={"n_boxes": n_coord // 4},
    )
    segment.validate()
    return segment


def run_bench_json(script: str, args: list[str], out, timeout_s: float = 600) -> dict:
    """Run ``bench/<script>`` with ``args`` (its ``--json out`` appended) from the repo root; its last stdout line
    parsed as JSON, checked equal to the file it wrote. Fails with the output tail on a non-zero exit."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, f"bench/{script}", *args, "--json", str(out)], cwd=repo,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last == json.loads(Path(out).read_text())
    return last
