"""What a weight sync leaves out: frozen modules stay on the server (declared at /sync/init, their bytes counted),
and ``model.adapter.sync: adapter`` pushes only the adapter, merged on the hf engine by peft (learner/weight_sync/base.py,
rollout_server/engines/adapter_merge.py). Real hf servers on loopback; the digests compare every element of the
complete served model."""

from __future__ import annotations

import httpx
import pytest
import torch

from common.config.load import ConfigError, load_config
from common.weight_sync import weights as W
from learner.recipe import adapter_push, frozen_names
from learner.weight_sync.session import SyncError
from learner.weight_sync.base import SyncReport, cast_stream, plan
from learner.weight_sync.served import named_weights
from learner.weight_sync.http import HttpWeightSender
from tests.server_proc import rollout_server_process
from tests.test_recipe import dora, policy, served_digest, train_steps, training

TOKEN = "adapter-sync-token"


def local_digest(info, served: dict[str, torch.Tensor]) -> str:
    """The exact digest of the learner's complete served model as the server holds it (its dtype)."""
    return W.exact_digest(cast_stream(info, plan(info, served.items())))


def manifest(client: HttpWeightSender):
    """The server's /sync/init answer (a session opened and aborted)."""
    session = client.open()
    session.abort("only the manifest was wanted")
    return session.info


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


@pytest.mark.slow
def test_a_frozen_module_is_not_synced_its_bytes_are_counted_and_the_checks_cover_it(tiny_model_dir):
    model, tokenizer, coord_ids = policy(tiny_model_dir, freeze=["vision"])
    train_steps(model, tokenizer, coord_ids, training(lr=1e-2))
    served = dict(named_weights(model))
    frozen = frozen_names(model)
    assert frozen and all(".visual." in n and ".merger." not in n for n in frozen)
    with rollout_server_process(tiny_model_dir, [f"rollout_server.auth_token={TOKEN}"]) as srv:
        client = HttpWeightSender(srv.url, auth_token=TOKEN, timeout_s=60, client_id="frozen-test")
        try:
            report = client.push(served.items(), bucket_bytes=1 << 20, skip=frozen)
            after = served_digest(srv, TOKEN)
            info = manifest(client)
            with pytest.raises(SyncError, match="skip: .*not a parameter of the served model"):
                client.push(served.items(), skip=["model.visual.no_such.weight"])
            # a learner whose frozen copy is not the server's (another checkpoint): the fingerprint of the complete
            # model refuses the commit, old weights kept (the learner then pushes in full: WeightSync._full_push)
            other = {**served, frozen[0]: served[frozen[0]] + 1.0}
            with pytest.raises(SyncError, match="fingerprint") as refused:
                client.push(other.items(), bucket_bytes=1 << 20, skip=frozen)
            assert refused.value.phase == "commit" and served_digest(srv, TOKEN) == after
            # a full push writes the frozen names: the server can no longer vouch that its copy is the checkpoint's
            full = client.push(served.items(), bucket_bytes=1 << 20)
            again = client.push(served.items(), bucket_bytes=1 << 20, skip=frozen)
        finally:
            client.close()
    frozen_bytes = nbytes((n, served[n]) for n in frozen)
    print(f"\nfrozen vision tower: {report.bytes} B sent, {report.skipped_bytes} B skipped of {nbytes(served.items())}")
    assert report.skipped_bytes == frozen_bytes and report.n_skipped == len(frozen)
    assert report.bytes == nbytes(served.items()) - frozen_bytes
    assert after.digests[0] == local_digest(info, served), "the complete served model equals the learner's"
    assert full.skipped_bytes == 0 and again.skipped_bytes == 0 and again.bytes == full.bytes


@pytest.mark.slow
def test_an_adapter_only_sync_lands_weights_whose_server_digest_equals_the_learners_merged_weights(tiny_model_dir):
    """DoRA on every linear layer but the frozen vision tower's, merger saved whole (modules_to_save): two adapter
    syncs with training between them, each digest equal to the learner's merged weights (the second merge starts
    from the base, not from the first); then the bytes of a merged push of the same weights, for comparison."""
    model, tokenizer, coord_ids = policy(tiny_model_dir, freeze=["vision"], adapter=dora(modules_to_save=["merger"]))
    frozen = frozen_names(model)
    with rollout_server_process(tiny_model_dir, [f"rollout_server.auth_token={TOKEN}"]) as srv:
        client = HttpWeightSender(srv.url, auth_token=TOKEN, timeout_s=60, client_id="adapter-test")
        try:
            first = served_digest(srv, TOKEN)
            reports, digests, locals_ = [], [], []
            for _ in range(2):
                train_steps(model, tokenizer, coord_ids, training(lr=1e-2))
                served = dict(named_weights(model))
                push = adapter_push(model)
                reports.append(client.push(served.items(), bucket_bytes=1 << 20, skip=frozen, adapter=push))
                digests.append(served_digest(srv, TOKEN))
                info = manifest(client)
                locals_.append(local_digest(info, served))
            # the same weights merged on the learner: the frozen names still stay, the merged layers travel whole
            merged = client.push(served.items(), bucket_bytes=1 << 20, skip=frozen)
        finally:
            client.close()
    full = nbytes(served.items())
    adapter_bytes = nbytes(push.tensors)
    print(f"\nbytes per sync (tiny Qwen2.5-VL, DoRA r8, float32): full weights {full}, merged {merged.bytes}, "
          f"adapter {reports[-1].bytes} (adapter tensors {adapter_bytes})")
    assert [r.ver for r in reports] == [first.ver + 1, first.ver + 2]
    assert digests[0].digests[0] == locals_[0] != first.digests[0]
    assert digests[1].digests[0] == locals_[1] != locals_[0], "the second sync merged from the base"
    merger = nbytes((n, t) for n, t in served.items() if ".visual.merger." in n)
    assert reports[-1].bytes == adapter_bytes + merger, "the adapter's tensors and the merger (modules_to_save)"
    assert reports[-1].bytes + reports[-1].skipped_bytes == full + adapter_bytes
    assert reports[-1].bytes < merged.bytes < full


@pytest.mark.slow
def test_an_adapter_sync_is_refused_when_the_server_lost_its_base_and_for_a_layer_it_does_not_serve(tiny_model_dir):
    model, tokenizer, coord_ids = policy(tiny_model_dir, adapter=dora(type="lora", target_modules=["q_proj"]))
    served = dict(named_weights(model))
    push = adapter_push(model)
    with rollout_server_process(tiny_model_dir, [f"rollout_server.auth_token={TOKEN}"]) as srv:
        client = HttpWeightSender(srv.url, auth_token=TOKEN, timeout_s=60, client_id="adapter-refusals")
        try:
            spec = push.spec.model_copy(update={"layers": ["model.no_such.q_proj"]})
            bad = type(push)(spec=spec, tensors=push.tensors)
            with pytest.raises(SyncError, match="adapter: .*not a parameter of the served model"):
                client.push(served.items(), adapter=bad)
            client.push(served.items())  # a merged push first: the q_proj weights on the server are no longer base
            with pytest.raises(SyncError, match="no longer holds their base.*restart the rollout server"):
                client.push(served.items(), adapter=push)
            health = httpx.get(srv.url + "/health", timeout=10).json()
        finally:
            client.close()
    assert health["status"] == "ok", "a refused session opens no fence"


def test_adapter_sync_with_the_vllm_engine_needs_the_http_transport_and_the_refusal_names_the_key_and_fix():
    overrides = ["model.adapter.type=dora", "model.adapter.sync=adapter", "rollout_server.engine=vllm"]
    cfg = load_config("configs/demo_cpu.yaml", [*overrides, "weight_sync.transport=http"])
    assert (cfg.model.adapter.sync, cfg.rollout_server.engine) == ("adapter", "vllm")
    for transport in ("nccl", "auto"):
        with pytest.raises(ConfigError) as err:
            load_config("configs/demo_cpu.yaml", [*overrides, f"weight_sync.transport={transport}"])
        assert "weight_sync.transport" in str(err.value) and "set weight_sync.transport: http" in str(err.value)


def test_after_a_server_refuses_a_push_that_kept_frozen_weights_every_later_push_to_it_is_full():
    """learner/weight_sync/boundary.py: a commit refused for its fingerprint after a skip / adapter push (the server's copy
    is not the learner's) switches that server to full pushes; the learner's training goes on either way."""
    from types import SimpleNamespace

    from learner.weight_sync.boundary import WeightSync

    cfg = load_config("configs/demo_cpu_qwen3_dora.yaml", [])
    sync = WeightSync(cfg, SimpleNamespace(is_main=True, rank=0))
    url = sync.servers[0]
    calls = []

    class Refusing:
        def push(self, source, *, skip, adapter, **kw):
            calls.append((list(skip), adapter))
            if skip or adapter is not None:
                raise SyncError("commit", "/sync/commit -> HTTP 400: staged weights fingerprint a != learner's b")
            return SyncReport(ver=7, fence_s=0.0, wire_s=0.0, commit_s=0.0, total_s=0.0, bytes=10, n_buckets=1, fingerprint="b")

        def close(self):
            pass

    sync._sender = lambda _url: Refusing()
    sync._frozen = ["model.visual.blocks.0.mlp.fc1.weight"]
    source = [("model.visual.blocks.0.mlp.fc1.weight", torch.zeros(2))]
    assert sync._push_all(lambda: source, step=0, ver=3)[:2] == (3, 0)
    assert url in sync._full_push
    assert sync._push_all(lambda: source, step=1, ver=3)[:2] == (7, 1)
    assert calls == [(sync._frozen, None), ([], None)]
