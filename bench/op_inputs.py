"""The operating-point bench's inputs, generated (GPU machines start bare and offline): synthetic records and their
PNGs, the preset's model folder, the actors' packs, a model with random weights (bench/bench_learner_op.py).

``--work DIR`` keeps the PNGs and records between calls of the bench on one machine (each row kind, each variant
of the code, each rank count is its own call; rendering 40 shapes at 1024 px takes ~1.4 s a core an image):
a call finds the records it needs in ``DIR/records-<n>-<side>-<objects>.json`` and renders only what is missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

def render_one(job: tuple[str, int, int, int]) -> dict:
    """One synthetic record (PNG written under ``root/images``): a process-pool job."""
    from common.data.synthetic import render_record

    root, index, side, max_objects = job
    image, record = render_record(31, index, sides=(side,), max_objects=max_objects)
    path = f"images/op-{index:05d}.png"
    image.save(Path(root) / path)
    return dict(record, images=[path])


def render_records(root: Path, n: int, side: int, max_objects: int, world: int = 1) -> list[dict]:
    """``n`` records, rendered in parallel unless ``root`` holds them from an earlier call (each of ``world`` ranks
    renders them all into its own ``root``, on its share of the cores)."""
    import multiprocessing

    kept = root / f"records-{n}-{side}-{max_objects}.json"
    if kept.is_file():
        return json.loads(kept.read_text())
    (root / "images").mkdir(parents=True, exist_ok=True)
    jobs = [(str(root), i, side, max_objects) for i in range(n)]
    procs = max(1, min(16, (os.cpu_count() or 1) // world))
    with multiprocessing.get_context("fork").Pool(procs) as pool:  # before CUDA starts
        records = pool.map(render_one, jobs)
    kept.write_text(json.dumps(records))
    return records


def model_dir(root: Path, preset: str, vocab: int | None, side: int) -> Path:
    """Config (``vocab`` embedding rows), tokenizer and a processor taking images up to ``side``² pixels."""
    from tools import make_tiny_model as mtm

    tok = mtm.build_tokenizer(True)
    config = mtm.build_config(preset, tok)
    if vocab:
        config.text_config.vocab_size = vocab
    config.save_pretrained(root)
    tok.save_pretrained(root)
    mtm.build_image_processor(max_pixels=side * side).save_pretrained(root)
    (root / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}) + "\n")
    return root


def make_packs(path: Path, records: list[dict], packing_length: int) -> list:
    """Channel-A segments of ``records`` packed as the actors pack (90 % fill or better)."""
    from common.detection.answer import canonical_order
    from common.data.records import load_record
    from common.packing.packer import Packer
    from common.detection.targets import channel_a_target
    from common.packing.encode import Encoder

    encoder = Encoder(path, packing_length, image_root=str(path))
    packer = Packer(packing_length, min_fill_ratio=0.9, max_wait_s=1e9, clock=lambda: 0.0)
    for i, raw in enumerate(records):
        record = load_record(raw)
        target = channel_a_target(canonical_order(record.objects), encoder.tokenizer, coord_ids=encoder.coord_ids)
        segment = encoder.encode(record, target, sample_id=f"op{i}", channel="A", ver=0)
        if segment is not None:
            packer.add(segment)
    return packer.pop_ready()


def build_model(path: Path, device, dtype):
    """Random weights made on ``device`` (N(0, 0.02); norms 1, biases 0), gradient checkpointing on."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from learner.blocks import set_checkpointing

    torch.manual_seed(0)
    with torch.device(device):  # the modules' own __init__ on the device: the rotary buffers are computed there
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path), dtype=dtype,
                                                        attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.tie_weights()
    set_checkpointing(model, 1)  # each row sets its own (+ckptN)
    model.config.use_cache = False
    return model.train()
