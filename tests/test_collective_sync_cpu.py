"""The collective weight-sync path (transport ``nccl``) end to end on CPU: gloo stands in for NCCL.

Learner side: ``learner.weight_sync.nccl.NcclWeightSender`` with the weights on CPU (so its group is gloo).
Server side: a real ``python -m rollout_server`` process with the hf engine on CPU, which joins the
group with gloo. Everything between them is what the GPU run uses: ``/sync/init`` with a rendezvous,
the group kept across pushes, ``/sync/begin``, ONE ``/sync/update`` while rank 0 broadcasts packed
chunks, ``/sync/commit`` with the fingerprint the server computed, and ``load`` in the update reply.
The GPU variants (NCCL, hf and vLLM engines) are tests/test_gpu_weight_sync.py and test_gpu_vllm.py.
"""

from __future__ import annotations

import httpx
import torch

from common.wire.http import InferItem, InferResponse, SamplingParams
from learner.weight_sync.nccl import NcclWeightSender
from common.weight_sync import weights as W
from tests.server_proc import rollout_server_process
from tests.test_fence import version_weights


ITEM = InferItem(prompt_token_ids=[5, 6, 7, 8, 9])
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def assert_served_greedy_is_the_learners(url: str, gen, ver: int) -> None:
    """The server's greedy output under ``ver`` equals the learner's own (the weights arrived, names mapped)."""
    r = httpx.post(url + "/infer", json={"items": [ITEM.model_dump(exclude_none=True)],
                                         "sampling": GREEDY.model_dump()}, timeout=60)
    served = InferResponse.model_validate_json(r.content)
    mine = gen.generate([ITEM.prompt_token_ids], [None], GREEDY)[0]
    assert served.ver == ver and served.outputs[0].token_ids == mine.token_ids


def test_collective_push_over_gloo_lands_every_weight_and_reuses_the_group(tiny_model_dir, caplog):
    from transformers import AutoModelForImageTextToText

    from common.generation.generator import HFGenerator
    from common.data.processor import load_processor

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = HFGenerator(model, load_processor(str(tiny_model_dir)), device="cpu", max_batch=2)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    with rollout_server_process(tiny_model_dir, ["rollout_server.dtype=float32"]) as srv:
        sender = NcclWeightSender(srv.url, timeout_s=60)
        try:
            for k in (1, 2):
                model.load_state_dict(version_weights(base, k), strict=False)
                report = sender.push(model.named_parameters(), bucket_bytes=256 << 10)
                assert report.ver == k and report.n_buckets > 1, report
                assert report.fingerprint == W.fingerprint(list(model.named_parameters()))
                assert report.server_load is not None and report.server_load["path"] == "staged", report.server_load
                assert report.server_load["worker_s"] > 0
                assert_served_greedy_is_the_learners(srv.url, gen, k)
            assert sender.groups_created == 1, "the group must be kept across pushes"
        finally:
            with caplog.at_level("INFO", logger="learner.weight_sync.nccl"):
                sender.close()
    # the run's end is not a failure: no "the next push builds a new one" warning (seen at the end of a GPU run)
    closing = [r for r in caplog.records if "weight-transfer group" in r.getMessage()]
    assert [r.levelname for r in closing] == ["INFO"] and "sender closed" in closing[0].getMessage(), closing
