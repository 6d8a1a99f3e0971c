"""Lean pixels on the actor -> learner wire (issue 31): uint8 levels in the processor's patch layout plus a per-column
affine, normalised on the learner's device into exactly the processor's float32 ``pixel_values``.

The reference is always the image processor's own float output for the same image. The processors: the tiny
model's (Qwen2-VL's CLIP mean/std, patch 14), the same at a 1024-px pixel budget, and a Qwen3-VL-style one
(mean = std = 0.5, patch 16, width 1536).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.packing.segment import Pack, Segment, SegmentError, pixel_floats
from common.packing.encode import pixel_affine, to_uint8_pixels

REPO = Path(__file__).resolve().parents[1]


def images(sides, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sides]


@pytest.fixture(scope="module")
def tiny_processor(tiny_model_dir):
    from common.data.processor import load_processor

    return load_processor(tiny_model_dir).image_processor


def qwen3_style_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": 3136, "longest_edge": 4 * 10**6})


def segment_of(pixels: np.ndarray, affine: np.ndarray, grid: list[int], sample_id: str) -> Segment:
    """An image segment with the right placeholder count; only its pixels matter here."""
    n = int(np.prod(grid)) // 4 + 3
    ids = np.arange(n, dtype=np.int64)
    labels = np.full(n, -100, np.int64)
    labels[-1] = 5
    return Segment(sample_id=sample_id, channel="B", ver=0, input_ids=ids, labels=labels,
                   weights=(labels != -100).astype(np.float32), position_ids=np.tile(ids, (3, 1)),
                   coord_pos=np.zeros(0, np.int64), coord_bins=np.zeros(0, np.int64), pixel_values=pixels,
                   image_grid_thw=np.array([grid], np.int64), pixel_affine=affine)


@pytest.mark.parametrize("which", ["tiny", "tiny_1024px", "qwen3_style"])
def test_the_learners_decoded_pixel_values_equal_the_image_processors_floats(which, tiny_processor):
    """Processor floats -> uint8 + affine -> pack -> wire frames -> learner pack_inputs (float32 and bf16)."""
    from common.wire.codec import frames_to_pack, pack_to_frames
    from learner.model import pack_inputs

    if which == "qwen3_style":
        ip, sides = qwen3_style_processor(), [(480, 640), (256, 256)]
    else:
        ip, sides = tiny_processor, [(90, 120), (200, 150)]
    size = {"shortest_edge": 3136, "longest_edge": 12845056} if which == "tiny_1024px" else None
    if size is not None:
        sides = [(1024, 1024)]
    segments, floats = [], []
    for i, img in enumerate(images(sides, seed=len(which))):
        out = ip(images=[img], return_tensors="np", **({"size": size} if size else {}))
        pv, grid = np.asarray(out["pixel_values"], np.float32), out["image_grid_thw"][0].tolist()
        affine = pixel_affine(ip, pv.shape[1])
        segments.append(segment_of(to_uint8_pixels(pv, affine), affine, grid, f"s{i}"))
        floats.append(pv)
    want = np.concatenate(floats)
    if which == "tiny_1024px":
        assert want.shape == (74 * 74, 1176), "a 1024-px image at Qwen2.5-VL's budget: 74 x 74 patches"
    if which == "qwen3_style":
        assert want.shape[1] == 1536
    message, _ = frames_to_pack(pack_to_frames(Pack(ver=0, channel="B", segments=segments), "actor-r0-0", 0))
    assert message.tensors["pixel_values"].dtype == np.uint8
    assert message.tensors["pixel_values"].nbytes * 4 == want.nbytes, "a quarter of the float32 bytes"
    np.testing.assert_allclose(pixel_floats(message.tensors["pixel_values"], message.tensors["pixel_affine"]), want,
                               rtol=0, atol=1e-6)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 0.0)):
        got = pack_inputs(message.tensors, "sdpa", dtype, torch.device("cpu")).model_kwargs["pixel_values"]
        assert got.dtype == dtype
        ref = torch.from_numpy(want).to(dtype)  # what the learner fed the model before: the processor's floats, cast
        if tol:
            torch.testing.assert_close(got, ref, rtol=0, atol=tol)
        else:
            # the float32 values may differ by an ulp (another order of the same affine arithmetic): where that
            # straddles a bf16 rounding boundary the cast differs by one bf16 step (one level of 255 at most)
            mismatch = (got != ref).float().mean().item()
            assert mismatch < 1 / 128, f"{mismatch:.2%} of the bf16 inputs differ from the cast processor floats"
            torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=0)  # at most one bf16 step apart


def test_processor_floats_that_are_not_uint8_levels_are_refused_naming_the_deviation(tiny_processor):
    out = tiny_processor(images=images([(64, 64)]), return_tensors="np")
    pv = np.asarray(out["pixel_values"], np.float32)
    affine = pixel_affine(tiny_processor, pv.shape[1])
    assert to_uint8_pixels(pv, affine).dtype == np.uint8
    resized_in_float = pv + 0.3 * affine[0]  # what a processor resizing float images would give: between levels
    with pytest.raises(ValueError, match=r"up to 0\.3 from an integer.*preprocessor_config\.json"):
        to_uint8_pixels(resized_in_float, affine)
    with pytest.raises(ValueError, match="not a Qwen-VL patch layout"):
        pixel_affine(tiny_processor, 1177)


def test_a_pack_refuses_float_pixels_and_mixed_normalisations_and_the_wire_refuses_a_missing_affine(tiny_processor):
    from common.wire.codec import ProtocolError, encode_pack_message, frames_to_pack

    out = tiny_processor(images=images([(64, 64)]), return_tensors="np")
    pv, grid = np.asarray(out["pixel_values"], np.float32), out["image_grid_thw"][0].tolist()
    affine = pixel_affine(tiny_processor, pv.shape[1])
    with pytest.raises(SegmentError, match="float32, the wire takes uint8"):
        segment_of(pv, affine, grid, "float").validate()
    a = segment_of(to_uint8_pixels(pv, affine), affine, grid, "a")
    b = segment_of(a.pixel_values, affine * 1.01, grid, "b")
    with pytest.raises(SegmentError, match="mixes pixel normalisations"):
        Pack(ver=0, channel="B", segments=[a, b]).tensors()
    pack = Pack(ver=0, channel="B", segments=[a])
    old = {k: v for k, v in pack.tensors().items() if k != "pixel_affine"}  # a schema-1 sender's arrays
    old["pixel_values"] = pv
    frames = encode_pack_message(ver=0, actor="old", seq=0, channel="B", n_segments=1, n_tokens=pack.n_tokens,
                                 tensors=old, meta={"segments": pack.segment_meta()})
    with pytest.raises(ProtocolError, match="pixel_affine"):
        frames_to_pack(frames)


def test_the_bench_reports_a_quarter_of_the_pixel_bytes_on_the_wire(tiny_model_dir):  # the bench reads the tiny model
    r = subprocess.run([sys.executable, str(REPO / "bench/bench_pack_bytes.py"), "--quick"], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["images"] >= 2 and row["tokens"] <= row["packing_length"]
    assert row["pixel_bytes_before"] == 4 * row["patches"] * row["patch_dim"]
    assert row["pixel_bytes_after"] - 8 * row["patch_dim"] == row["patches"] * row["patch_dim"]  # + the affine
    assert row["bytes_after"] < 0.3 * row["bytes_before"]
    assert row["max_abs_pixel_error"] < 1e-5
