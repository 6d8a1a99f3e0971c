"""The warm-started tiny detector, driven through the real rollout server: it detects.

The detector is ``tiny_detector_dir`` (tests/conftest.py): the tiny Qwen2.5-VL after a Stage-1 warm
start on one-shape images. The server is the real ``python -m rollout_server`` (hf engine) on loopback;
the request is what an actor sends (the training prompt of configs/warm_start_cpu.yaml, the image by
path), and the answer is parsed by the strict parser and matched by the project's matcher.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer

from common.detection.answer import Prompts
from common.data.records import load_record
from common.config.load import load_config
from common.evaluation.loop import rollout_item
from common.detection.matching import box_iou
from common.detection.parsing import parse_rollout
from common.wire.http import InferRequest, InferResponse, SamplingParams
from common.detection.coord_tokens import require_coord_tokens
from tests.server_proc import REPO, rollout_server_process

pytestmark = pytest.mark.slow


def _prompts() -> Prompts:
    cfg = load_config(REPO / "configs" / "warm_start_cpu.yaml", world_size=1)
    return Prompts.of(cfg.data.system_prompt, cfg.data.user_prompt)


def test_a_greedy_rollout_of_a_validation_image_finds_its_object_at_iou_half(tiny_detector_dir: Path,
                                                                              detector_data_dir: Path):
    data = detector_data_dir
    records = [load_record(json.loads(line)) for line in (data / "val.jsonl").read_text().splitlines()[:8]]
    tokenizer = AutoTokenizer.from_pretrained(tiny_detector_dir)
    coord_ids = require_coord_tokens(tokenizer, str(tiny_detector_dir))
    items = [rollout_item(r, [str(data / p) for p in r.images], item_id=r.id, prompts=_prompts()) for r in records]
    body = InferRequest(items=items, sampling=SamplingParams(temperature=0.0, max_tokens=64, seed=0))
    with rollout_server_process(tiny_detector_dir) as srv:
        resp = httpx.post(srv.url + "/infer", content=body.model_dump_json(exclude_none=True),
                          headers={"Content-Type": "application/json"}, timeout=120.0)
    assert resp.status_code == 200, resp.text
    outputs = InferResponse.model_validate_json(resp.content).outputs
    found, empty, report = 0, 0, []
    for record, out in zip(records, outputs):
        parsed = parse_rollout(out.token_ids, tokenizer, coord_ids=coord_ids)
        gt = np.array([o.bins for o in record.objects])
        best = 0.0
        if parsed.valid_objects:
            best = float(box_iou(np.array([o.bins for o in parsed.valid_objects]), gt).max())
        found += best >= 0.5
        empty += not parsed.valid_objects
        report.append(f"{record.id}: {len(parsed.valid_objects)} valid, best IoU {best:.2f}: {out.text[:90]!r}")
    # Every answer is well-formed, and the detector localises: most images have their object matched at
    # IoU >= 0.5 (a detector that ignored the image would place every box alike and match about 1 in 8).
    assert empty == 0, f"{empty}/8 answers parsed to no valid object:\n" + "\n".join(report)
    assert found >= 4, f"{found}/8 images matched at IoU >= 0.5:\n" + "\n".join(report)
