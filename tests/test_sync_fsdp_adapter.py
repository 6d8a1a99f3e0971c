"""What a sharded (FSDP2) push leaves out: frozen names the server keeps and, with ``model.adapter.sync: adapter``,
the adapted layers' weights (the adapter's tensors travel; the server merges with peft). 2 real gloo ranks under
``torchrun`` (the worker of this file), one real hf rollout server on loopback, the learner's own ``WeightSync``.

One torchrun runs both scenarios against one server, in this order (a server refuses an adapter session once a
push overwrote the adapted layers' base, so the adapter run comes first):

    adapter   DoRA rank 4 all-linear, vision frozen, the merger in modules_to_save: two blocking syncs with a
              training step before each, then an overlap push from a snapshot
    frozen    a full fine-tune with ``freeze: [vision]``: two blocking syncs with a training step before each

Expected digests are computed apart from the sync code (tests/test_sync_fsdp.py ``_expected`` /
``_expected_merged``: torch's full state dict, for the adapter merged in place by peft). Each rank writes
``rank<r>.json``; the parent asserts on the merged results.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # when torchrun runs this file as a rank worker
    sys.path.insert(0, str(REPO))

ADAPTER = ("model.adapter={type: dora, rank: 4, alpha: 8, target_modules: all-linear, modules_to_save: [merger], "
           "sync: adapter}")
SCENARIOS = {"adapter": [ADAPTER, "model.freeze=[vision]"], "frozen": ["model.freeze=[vision]"]}
SMALL_BUCKET = 256 << 10  # several buckets for the 3.3 MB tiny model


# ----------------------------------------------------------------------------------------------- rank worker


def _worker(args: list[str]) -> None:
    import argparse
    import logging

    import torch
    from transformers import AutoModelForImageTextToText

    from common.config.load import load_config
    from learner.distributed import Dist
    from learner.parallel import wrap
    from learner.recipe import apply_recipe
    from tests.test_sync_fsdp import _Trainer, rank_result

    ap = argparse.ArgumentParser()
    ap.add_argument("scenarios", choices=["all"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--url", required=True)
    a = ap.parse_args(args)
    logging.basicConfig(level=logging.INFO, format="rank %(process)d %(name)s: %(message)s")
    dist = Dist("gloo", timeout_s=120)
    with rank_result(dist, a.out) as result:
        ver = 0
        for scenario, recipe in SCENARIOS.items():
            cfg = load_config(REPO / "configs/demo_cpu.yaml", [
                f"model.path={a.model}", f"rollout_matching.vllm.servers=[{{base_url: '{a.url}'}}]",
                "learner.parallel=fsdp", "weight_sync.transport=http", "weight_sync.timeout_s=30",
                "learner.collective_timeout_s=120", f"learner.nproc_per_node={dist.world_size}", *recipe],
                world_size=dist.world_size)
            model = AutoModelForImageTextToText.from_pretrained(a.model, dtype=torch.float32)
            apply_recipe(model, cfg.model)  # as learner/model.py does, before the wrap
            model = wrap(model, cfg.learner, torch.device("cpu"), dist.world_size, dist.local_rank)
            result[scenario] = _syncs(scenario, dist, model, _Trainer(model, dist.rank, "cpu"), cfg, a, ver)
            ver = result[scenario]["pushes"][-1]["ver"]


def _syncs(scenario: str, dist, model, trainer, cfg, a, ver: int) -> dict:
    """Two blocking syncs, a training step before each, through one ``WeightSync`` (its frozen samples kept)."""
    from learner.recipe import adapter_push, frozen_names, group_of, hf_name
    from learner.weight_sync.boundary import WeightSync
    from learner.weight_sync.served import named_weights
    from tests.test_sync_fsdp import _expected, _expected_merged, _served

    sync = WeightSync(cfg, dist)
    sync.bucket_bytes = SMALL_BUCKET
    frozen = set(frozen_names(model))
    params = [(hf_name(n), p) for n, p in model.named_parameters() if ".original_module." not in n]
    out: dict = {"pushes": [], "n_served": len(list(named_weights(model))), "n_frozen": len(frozen),
                 "served_bytes": _nbytes(params),
                 "vision_bytes": _nbytes((n, p) for n, p in params if group_of(n) == "vision"),
                 "frozen_bytes": _nbytes((n, p) for n, p in params if n in frozen)}
    if scenario == "adapter":
        push = adapter_push(model)
        saved = [(n, p) for n, p in model.named_parameters() if ".modules_to_save.default." in n]
        out.update(n_layers=len(push.spec.layers), n_adapter=len(push.tensors), adapter_bytes=_nbytes(push.tensors),
                   n_saved=len(saved), saved_trained=all(p.requires_grad for _, p in saved),
                   saved_bytes=_nbytes(saved))
    for step in (1, 2):
        trainer.step()
        gathers = sync.gathers
        t0 = time.monotonic()
        res = sync.run(model, step, ver)
        entry = {"ok": res.ok, "ver": res.ver, "gathers": sync.gathers - gathers, "s": time.monotonic() - t0,
                 "bytes": res.metrics.get("sync/bytes"), "skipped_bytes": res.metrics.get("sync/skipped_bytes")}
        ver = res.ver
        expected = (_expected_merged(model, dist, cfg, a.model, a.url) if scenario == "adapter"
                    else _expected(model, dist, a.url))
        if dist.is_main:
            entry.update(served=_served(a.url), expected=expected)
        out["pushes"].append(entry)
    out["fallbacks"] = sync.counts["sync/adapter_fallbacks"]
    sync.close()
    if scenario == "adapter":
        out["overlap"] = _overlap(dist, model, trainer, cfg, a, ver)
    return out


def _overlap(dist, model, trainer, cfg, a, ver: int) -> dict:
    """``weight_sync.mode: overlap``: after the blocking start-up sync, a due boundary gathers a snapshot of the
    served weights and the adapter's tensors on every rank, and rank 0's push thread sends the adapter from it
    while training moves on."""
    from learner.weight_sync.boundary import WeightSync
    from tests.test_sync_fsdp import _expected_merged, _served

    cfg.weight_sync.mode = "overlap"
    step = 3
    sync = WeightSync(cfg, dist, progress=lambda: step)
    sync.bucket_bytes = SMALL_BUCKET
    ver = sync.boundary(model, step, ver).ver  # start-up (blocking)
    trainer.step()
    step += sync.every
    at_snapshot = _expected_merged(model, dist, cfg, a.model, a.url)
    started = sync.boundary(model, step, ver)
    trainer.step()  # the weights move on while the push runs: the server must get the snapshot's
    settled = sync.settle(model, step, ver, "the test")
    entry = {"started": started.metrics.get("sync/started"), "ok": settled.ok, "ver": settled.ver,
             "ver_before": ver, "bytes": settled.metrics.get("sync/bytes"),
             "fallbacks": sync.counts["sync/adapter_fallbacks"]}
    if dist.is_main:
        entry.update(served=_served(a.url), expected=at_snapshot)
    sync.close()
    return entry


def _nbytes(named) -> int:
    """Bytes of the full tensors (a DTensor's numel is its global one)."""
    return sum(t.numel() * t.element_size() for _, t in named)


if __name__ == "__main__" and "--worker" in sys.argv:
    from tests.test_sync_fsdp import leave_after

    leave_after(_worker, [x for x in sys.argv[1:] if x != "--worker"])


# ----------------------------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def synced(tiny_model_dir, tmp_path_factory):
    from tests.server_proc import rollout_server_process
    from tests.test_sync_fsdp import _run

    with rollout_server_process(tiny_model_dir, []) as srv:
        t0 = time.monotonic()
        tmp = tmp_path_factory.mktemp("fsdp-skip")
        results = _run(tmp, "all", [srv.url], tiny_model_dir, script=__file__)
        print(f"\nfsdp skip + adapter scenarios: {time.monotonic() - t0:.1f}s")
        return results


@pytest.mark.slow
def test_a_sharded_push_leaves_the_frozen_vision_tower_on_the_server_and_the_served_model_is_the_learners(synced):
    r0, r1 = synced
    run0, run1 = r0["frozen"], r1["frozen"]
    assert run0["vision_bytes"] == run0["frozen_bytes"] > 0, "freeze: [vision] freezes exactly the vision tower"
    for k, (p0, p1) in enumerate(zip(run0["pushes"], run1["pushes"])):
        assert p0["ok"] and p1["ok"] and p0["ver"] == p1["ver"] == p0["served"]["ver"], k
        assert p0["served"]["digests"] == [p0["expected"]["digest"]], f"push {k}: served != the learner's model"
        assert p0["skipped_bytes"] == run0["vision_bytes"], f"push {k}: the vision tower stays on the server"
        assert p0["bytes"] == run0["served_bytes"] - run0["vision_bytes"], f"push {k}: every other weight travels"
        assert p0["gathers"] == p1["gathers"], f"push {k}: every rank runs the same gathers"
    first, second = run0["pushes"]
    assert first["expected"]["digest"] != second["expected"]["digest"], "a training step between the pushes"
    n, frozen = run0["n_served"], run0["n_frozen"]
    # the first push gathers the vision tower once, aside, for the fingerprint; rank 0 keeps its samples after
    assert (first["gathers"], second["gathers"]) == (n, n - frozen)
    assert r0["aligned"] == r1["aligned"] == 2


@pytest.mark.slow
def test_a_sharded_adapter_sync_sends_the_adapter_and_lands_peft_merged_weights_twice(synced):
    r0, r1 = synced
    run0, run1 = r0["adapter"], r1["adapter"]
    assert run0["fallbacks"] == 0, "the server took the adapter session"
    digests = []
    for k, (p0, p1) in enumerate(zip(run0["pushes"], run1["pushes"])):
        assert p0["ok"] and p1["ok"] and p0["ver"] == p1["ver"] == p0["served"]["ver"], k
        assert p0["served"]["digests"] == [p0["expected"]["digest"]], f"push {k}: served != peft's merge"
        assert p0["bytes"] == run0["adapter_bytes"] + run0["saved_bytes"], f"push {k}: adapter + merger only"
        assert p0["gathers"] == p1["gathers"], f"push {k}: every rank runs the same gathers"
        digests.append(p0["expected"]["digest"])
    assert digests[0] != digests[1], "a training step between the syncs: the second merged from the base"
    assert run0["n_saved"] and run0["saved_trained"], "the merger trains whole (modules_to_save)"
    # what is gathered: the adapter's tensors and the merger to send them, each adapted layer's 4 DoRA parts
    # (W, A, B, m) for the fingerprint; the frozen names once (their samples are kept), never sent
    per_sync = 4 * run0["n_layers"] + run0["n_adapter"] + run0["n_saved"]
    first, second = run0["pushes"]
    assert (first["gathers"], second["gathers"]) == (per_sync + run0["n_frozen"], per_sync)


@pytest.mark.slow
def test_an_overlap_push_under_fsdp_sends_the_adapter_from_its_snapshot(synced):
    r0, r1 = synced
    run0, o0, o1 = r0["adapter"], r0["adapter"]["overlap"], r1["adapter"]["overlap"]
    assert o0["started"] == o1["started"] == 1 and o0["fallbacks"] == 0
    assert o0["ok"] and o1["ok"] and o0["ver"] == o1["ver"] == o0["ver_before"] + 1 == o0["served"]["ver"]
    assert o0["served"]["digests"] == [o0["expected"]["digest"]], "served != peft's merge of the snapshot"
    assert o0["bytes"] == run0["adapter_bytes"] + run0["saved_bytes"], "adapter + merger only"
