"""Bytes of one pack on the actor -> learner wire: pixels as float32 (schema 1) and as uint8 + affine (schema 2).

    python bench/bench_pack_bytes.py              # 1024-px images, up to 40 objects, packing 12000 (issue 31)
    python bench/bench_pack_bytes.py --quick      # make test: 224-px images, packing 2048, a few seconds

Encodes synthetic records (``common.data.synthetic``: one ``side × side`` image each) into Channel-A segments with
the tiny model's :class:`~common.packing.encode.Encoder`, its image processor set to Qwen2.5-VL's pixel budget
(3,136 .. 12,845,056 pixels, patch 14, merge 2: a 1024-px image is 74 × 74 patches, 1,369 tokens). The answers
are tokenised by the tiny tokenizer (its desc text is shorter than Qwen's BPE, which only makes the pixel
share of the pack larger). Segments fill one pack first-fit up to ``--packing-length``; the pack is framed as
the actor frames it (``common.wire.codec.pack_to_frames``, schema 2) and, for the before figure, with the same arrays
but ``pixel_values`` as the processor's float32 and no ``pixel_affine`` (the schema-1 layout, through the same
``encode_pack_message``). Bytes = the sum of the frame lengths, header included. Also checks that the learner's
decoded pixels (``pixel_floats``) equal the processor's floats. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: Qwen2.5-VL's image processor defaults (preprocessor_config.json of Qwen/Qwen2.5-VL-3B-Instruct).
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 3136, 12845056


def build_pack(side: int, packing_length: int, max_objects: int, n_records: int, work: Path):
    """(the pack, the processor's float pixel_values of its images in pack order)."""
    import numpy as np

    from common.detection.answer import canonical_order
    from common.data.records import iter_jsonl
    from common.packing.segment import Pack
    from common.data.synthetic import generate
    from common.detection.targets import channel_a_target
    from common.packing.encode import Encoder
    from tools.make_tiny_model import ensure_tiny_model

    model = ensure_tiny_model(REPO / "artifacts" / "tiny-model")
    data = generate(work / "data", split=(n_records, 1), seed=0, sides=(side,), max_objects=max_objects)
    encoder = Encoder(model, packing_length, image_root=str(data.parent))
    ip = encoder.processor.image_processor
    ip.size = {"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS}
    segments, floats, used = [], [], 0
    for i, record in enumerate(iter_jsonl(data)):
        paths = encoder.image_paths(record)
        prompt = encoder.prompt(record, paths)
        target = channel_a_target(canonical_order(record.objects), encoder.tokenizer, coord_ids=encoder.coord_ids)
        segment = encoder.encode(record, target, sample_id=f"s{i}", channel="A", ver=0, prompt=prompt)
        if segment is None or used + segment.length > packing_length:
            continue
        segments.append(segment)
        used += segment.length
        from PIL import Image

        images = [Image.open(p).convert("RGB") for p in paths]
        floats.append(np.asarray(ip(images=images, return_tensors="np")["pixel_values"], np.float32))
    if not segments:
        raise SystemExit(f"no {side}-px segment fits a pack of {packing_length} tokens: raise --packing-length")
    return Pack(ver=0, channel="A", segments=segments), np.concatenate(floats)


def measure(side: int, packing_length: int, max_objects: int, n_records: int) -> dict:
    import numpy as np

    from common.packing.segment import pixel_floats
    from common.wire.codec import encode_pack_message, frames_to_pack, pack_to_frames

    with tempfile.TemporaryDirectory() as tmp:
        pack, floats = build_pack(side, packing_length, max_objects, n_records, Path(tmp))
    frames = pack_to_frames(pack, "bench", 0)
    after = sum(len(memoryview(f).cast("B")) for f in frames)
    tensors = pack.tensors()
    old = {k: v for k, v in tensors.items() if k != "pixel_affine"}
    old["pixel_values"] = pixel_floats(tensors["pixel_values"], tensors["pixel_affine"])
    old_frames = encode_pack_message(ver=0, actor="bench", seq=0, channel="A", n_segments=len(pack.segments),
                                     n_tokens=pack.n_tokens, tensors=old, meta={"segments": pack.segment_meta()})
    before = sum(len(memoryview(f).cast("B")) for f in old_frames)
    message, _ = frames_to_pack(frames)
    decoded = pixel_floats(message.tensors["pixel_values"], message.tensors["pixel_affine"])
    n_images = int(tensors["image_grid_thw"].shape[0])
    return {
        "side": side, "packing_length": packing_length, "tokens": pack.n_tokens, "segments": len(pack.segments),
        "images": n_images, "patches": int(tensors["pixel_values"].shape[0]),
        "patch_dim": int(tensors["pixel_values"].shape[1]),
        "bytes_before": before, "bytes_after": after, "ratio": round(after / before, 4),
        "pixel_bytes_before": int(old["pixel_values"].nbytes),
        "pixel_bytes_after": int(tensors["pixel_values"].nbytes + tensors["pixel_affine"].nbytes),
        "mb_per_image_before": round(old["pixel_values"].nbytes / n_images / 1e6, 2),
        "mb_per_image_after": round(tensors["pixel_values"].nbytes / n_images / 1e6, 2),
        "max_abs_pixel_error": float(np.abs(decoded - floats).max()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", type=int, default=1024, help="image side in pixels")
    ap.add_argument("--packing-length", type=int, default=12000, help="tokens per pack (training.global_max_length)")
    ap.add_argument("--objects", type=int, default=40, help="most objects per image")
    ap.add_argument("--records", type=int, default=12, help="records encoded to fill the pack")
    ap.add_argument("--quick", action="store_true", help="224-px images, packing 2048 (make test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.side, args.packing_length, args.objects, args.records = 224, 2048, 10, 6
    print(json.dumps(measure(args.side, args.packing_length, args.objects, args.records)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
