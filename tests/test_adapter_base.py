"""Adapter sync for the vLLM engine, the parts that need no vLLM: the base weights read from the model directory
(rollout_server/engines/adapter_base.py), the session terms per transport and the merge-then-stage step of
rollout_server/engines/vllm/adapter.py (the engine built without AsyncLLM: nothing here reaches a worker), and the
learner's fallback to merged pushes when a server refuses the adapter session (learner/weight_sync/boundary.py).
Both families' tiny models; the merged tensors must equal the learner's ``merged_weight`` bit for bit."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
import torch

from common.weight_sync import packed as P
from common.weight_sync import weights as W
from common.weight_sync.shared import SHM_DIR
from learner.recipe import adapter_push, merged_weight
from learner.weight_sync.base import SyncReport
from learner.weight_sync.session import SyncError
from rollout_server.engines.adapter_base import AdapterStage, base_weights, layer_shapes, load_hf_model
from rollout_server.engines.adapter_merge import AdapterMerger
from rollout_server.engines.base import WeightUpdateError
from tests.test_recipe import dora, policy


@pytest.fixture(params=["qwen2.5-vl", "qwen3-vl"])
def model_dir(request, tiny_model_dir, tiny_qwen3_model_dir):
    return tiny_model_dir if request.param == "qwen2.5-vl" else tiny_qwen3_model_dir


def served_manifest(model_dir):
    """The served manifest as the vLLM engine builds it (the architecture, float32 here)."""
    model = load_hf_model(str(model_dir), torch.float32)
    specs, tied = W.manifest_of(model)
    return {s.name: s for s in specs}, {n: g[0] for g in tied for n in g[1:]}, model


def adapted(model_dir, kind: str):
    """The learner's policy with a LoRA/DoRA adapter on every linear layer, B and the magnitude made non-zero and
    off their init (so the merge matters), and its adapter push."""
    model, _, _ = policy(model_dir, adapter=dora(type=kind, rank=8))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name or ".lora_magnitude_vector." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model, adapter_push(model)


def test_base_weights_are_the_adapted_layers_as_the_learner_loads_them_and_a_missing_layer_is_named(model_dir):
    manifest, alias, served = served_manifest(model_dir)
    model, push = adapted(model_dir, "lora")
    layers = push.spec.layers
    assert any(".language_model." in layer for layer in layers), layers[:3]
    shapes = layer_shapes(push.spec, manifest, alias)
    base = base_weights(str(model_dir), push.spec, shapes)
    params = dict(served.named_parameters())
    assert set(base) == set(layers)
    for layer in layers:
        assert list(base[layer].shape) == manifest[f"{layer}.weight"].shape
        assert torch.equal(base[layer], params[f"{layer}.weight"]), layer
    bad = push.spec.model_copy(update={"layers": [layers[0], "model.language_model.no_such.q_proj"]})
    with pytest.raises(WeightUpdateError, match="adapter layer 'model.language_model.no_such.q_proj'") as err:
        layer_shapes(bad, manifest, alias)
    assert err.value.field == "adapter"
    with pytest.raises(WeightUpdateError, match="no_such.*has no") as err:  # a directory without the layer
        base_weights(str(model_dir), bad, {**shapes, bad.layers[1]: [2, 2]})
    assert err.value.field == "adapter"
    with pytest.raises(WeightUpdateError, match="the server serves"):
        base_weights(str(model_dir), push.spec, {**shapes, layers[0]: [1, 1]})


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_the_merge_of_a_pushed_adapter_equals_the_learners_merged_weights_bit_for_bit(model_dir, kind):
    manifest, alias, _ = served_manifest(model_dir)
    model, push = adapted(model_dir, kind)
    shapes = layer_shapes(push.spec, manifest, alias)
    stage = AdapterStage(AdapterMerger(push.spec, base_weights(str(model_dir), push.spec, shapes)), shapes)
    for name, t in push.tensors[:-1]:
        stage.take(name, t)
    with pytest.raises(WeightUpdateError, match="sent twice"):
        stage.take(*push.tensors[0])
    with pytest.raises(WeightUpdateError, match="1 of .* adapter tensors were not sent"):
        stage.merged(torch.float32)
    stage.take(*push.tensors[-1])
    merged = stage.merged(torch.float32)
    layers = dict(model.named_modules())
    assert set(merged) == {f"{layer}.weight" for layer in push.spec.layers}
    for layer in push.spec.layers:
        want = merged_weight(layers[layer])
        assert torch.equal(merged[f"{layer}.weight"], want), layer
    assert stage.merge_s is not None and stage.merge_s >= 0


def vllm_engine(model_dir):
    """The vLLM engine's session logic without AsyncLLM (``start`` never runs: no vLLM here)."""
    from rollout_server.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.model_path, engine._dtype = str(model_dir), "float32"
    engine._written, engine._skip = set(), set()
    engine._staged, engine._host_buckets, engine._received = {}, [], set()
    engine._nccl_updating = engine._fast_updated = False
    engine.last_update_info = None
    manifest, alias, _ = served_manifest(model_dir)
    engine._set_manifest(list(manifest.values()), [[first, *[n for n, g in alias.items() if g == first]]
                                                   for first in sorted(set(alias.values()))])
    return engine


def test_the_vllm_engine_takes_skips_and_adapters_over_http_and_merges_then_stages_at_commit(tiny_model_dir):
    if not os.path.isdir(SHM_DIR):
        pytest.skip("needs /dev/shm (the vLLM engine stages HTTP buckets there)")
    from rollout_server.engines.vllm.adapter import ADAPTER_TRANSPORT_FIX, NCCL_SKIP_REFUSED

    engine = vllm_engine(tiny_model_dir)
    model, push = adapted(tiny_model_dir, "dora")
    frozen = ["model.visual.patch_embed.proj.weight"]
    # nccl (init_nccl ran for this /sync/init): skips sent in full, an adapter refused naming the fix
    engine._nccl_pending = True
    terms = engine.open_session(frozen, None)
    assert terms.skip == [] and terms.skip_refused == NCCL_SKIP_REFUSED
    engine._end_session()
    engine._nccl_pending = True
    with pytest.raises(WeightUpdateError, match="weight_sync.transport: http") as err:
        engine.open_session(frozen, push.spec)
    assert err.value.field == "adapter" and not engine._nccl_pending
    # http: both taken; the adapter's tensors staged apart, an adapted layer's own weight refused
    terms = engine.open_session(frozen, push.spec)
    assert terms.skip == frozen and terms.skip_refused is None
    assert [s.name for s in terms.adapter_manifest] == [n for n, _ in push.tensors]
    layer = push.spec.layers[0]
    with pytest.raises(WeightUpdateError, match="adapted layer's weight"):
        asyncio.run(engine.stage_bucket({f"{layer}.weight": torch.zeros(manifest_shape(engine, layer))}))
    with pytest.raises(WeightUpdateError, match=ADAPTER_TRANSPORT_FIX[:40]):  # ipc: refused before any load
        engine._refuse_adapter_ipc()
    try:
        nbytes = asyncio.run(engine.stage_bucket(dict(push.tensors)))
        assert nbytes == sum(t.numel() * t.element_size() for _, t in push.tensors) and not engine._host_buckets
        asyncio.run(engine._stage_merged())  # what commit does before the workers load every staged bucket
        (layout, buf), = engine._host_buckets
        staged = P.unpack(buf.tensor[:P.nbytes_of(layout)], [e[0] for e in layout], [e[1] for e in layout],
                          [e[2] for e in layout], [e[3] for e in layout])
        modules = dict(model.named_modules())
        assert set(staged) == {f"{name}.weight" for name in push.spec.layers} == set(engine._staged)
        for name in push.spec.layers:
            assert torch.equal(staged[f"{name}.weight"], merged_weight(modules[name])), name
    finally:
        asyncio.run(engine.discard())
    assert engine._adapter is None and engine._skip == set() and not engine._host_buckets


def manifest_shape(engine, layer):
    return engine._manifest[f"{layer}.weight"].shape


def test_a_server_that_refuses_the_adapter_session_gets_merged_pushes_logged_and_counted(caplog):
    """learner/weight_sync/boundary.py: a 400 naming ``adapter`` (vLLM over nccl or ipc) is not a failed sync: the
    same boundary pushes the merged weights, and every later push to that server is merged (frozen names still
    declared), counted in ``sync/adapter_fallbacks`` and logged with the server's reason."""
    from common.config.load import load_config
    from learner.weight_sync.boundary import WeightSync

    cfg = load_config("configs/demo_cpu_qwen3_dora.yaml", [])
    sync = WeightSync(cfg, SimpleNamespace(is_main=True, rank=0))
    calls = []

    class Refusing:
        def push(self, source, *, skip, adapter, **kw):
            calls.append((list(skip), adapter is not None))
            if adapter is not None:
                raise SyncError("init", "/sync/init -> HTTP 400: adapter: the vllm engine merges a pushed adapter "
                                "over transport http only", 400)
            return SyncReport(ver=5, fence_s=0.0, wire_s=0.0, commit_s=0.0, total_s=0.0, bytes=10, n_buckets=1, fingerprint="b")

        def close(self):
            pass

    sync._sender = lambda _url: Refusing()
    sync._frozen = ["model.visual.blocks.0.mlp.fc1.weight"]
    spec = SimpleNamespace(layers=["model.language_model.layers.0.mlp.up_proj"])
    sync._adapter = SimpleNamespace(spec=spec, tensors=[("a.lora_A.weight", torch.zeros(1))])
    source = [("model.visual.blocks.0.mlp.fc1.weight", torch.zeros(2)), ("a.lora_A.weight", torch.zeros(1))]
    with caplog.at_level("WARNING"):
        assert sync._push_all(lambda: source, step=0, ver=3)[:2] == (5, 1)
        assert sync._push_all(lambda: source, step=1, ver=5)[:2] == (5, 1)
    assert calls == [(sync._frozen, True), (sync._frozen, False), (sync._frozen, False)]
    assert sync.counts["sync/adapter_fallbacks"] == 1
    assert "refused the adapter push" in caplog.text and "transport http only" in caplog.text
