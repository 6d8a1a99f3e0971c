"""tandem's vLLM worker extension (rollout_server/engines/vllm/extension.py) on a worker-shaped host.

vLLM mixes the extension into its GPU worker; here the host carries the attributes the extension
reads from that worker (model_config.quantization, device, weight_transfer_engine.model and its
model_update_group) around the vLLM-like model of tests/test_load_plan.py, on CPU. The GPU run of
the real thing is tests/test_gpu_vllm.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.weight_sync import weights as W
from rollout_server.engines.vllm.extension import TandemWorkerExtension
from rollout_server.engines.vllm.load_plan import stream_key
from tests.test_load_plan import VllmLike, hf_weights, native, same, stream


class Group:
    """The communicator's broadcast, fed from the learner's packed chunks."""

    def __init__(self, chunks):
        self.chunks = iter(chunks)

    def broadcast(self, buf, src, stream=None):
        assert src == 0
        buf.copy_(next(self.chunks))


class Worker(TandemWorkerExtension):
    def __init__(self, quantization=None):
        self.model_config = SimpleNamespace(quantization=quantization)
        self.device = torch.device("cpu")
        self.weight_transfer_engine = SimpleNamespace(model=VllmLike(), model_update_group=None)


def layout_of(weights, bucket_bytes=600):
    specs = [("bfloat16", list(t.shape)) for _, t in weights]
    return {"names": [n for n, _ in weights], "dtypes": [d for d, _ in specs], "shapes": [s for _, s in specs],
            "offsets": [list(o) for o in W.packed_offsets(specs)], "bucket_bytes": bucket_bytes}


def test_prepare_then_receive_loads_what_the_native_loaders_would():
    w = Worker()
    for seed in (1, 2):
        weights = hf_weights(seed)
        info = w.tandem_prepare(layout_of(weights))
        assert info["ok"] and info["recorded"] is (seed == 1), info
        w.weight_transfer_engine.model_update_group = Group(stream(weights, 600)[1])
        out = w.tandem_receive(timeout_s=30)
        assert out["bytes"] == sum(t.numel() * 2 for _, t in weights)
        same(w.weight_transfer_engine.model, native(weights))
    assert w.tandem_digest() == W.exact_digest(native(hf_weights(2)).named_parameters())


def test_layerwise_reload_wrappers_defer_the_fast_path_for_one_sync_only():
    w = Worker()
    model = w.weight_transfer_engine.model

    def online_process_loader(*a, **k):  # the name vLLM's layerwise-reload wrapper carries
        raise AssertionError("must not be called while recording")
    model.qkv.weight_loader = online_process_loader
    info = w.tandem_prepare(layout_of(hf_weights(1)))
    assert not info["ok"] and info["transient"] and "'qkv'" in info["reason"], info
    del model.qkv.weight_loader  # what vLLM's native update does once the layer is loaded
    assert w.tandem_prepare(layout_of(hf_weights(1)))["ok"]
    # A held plan replays without calling any loader: the wrappers only guard a recording.
    model.qkv.weight_loader = online_process_loader
    info = w.tandem_prepare(layout_of(hf_weights(1)))
    assert info["ok"] and info["recorded"] is False, info


def test_quantized_models_and_computing_loaders_are_refused_for_good():
    info = Worker(quantization="fp8").tandem_prepare(layout_of(hf_weights(1)))
    assert not info["ok"] and not info.get("transient") and "quantized" in info["reason"]
    w = Worker()
    w.weight_transfer_engine.model.mode = "index"
    info = w.tandem_prepare(layout_of(hf_weights(1)))
    assert not info["ok"] and not info.get("transient") and "index_copy" in info["reason"]


def test_running_out_of_memory_for_the_buffers_refuses_with_the_keys_that_fix_it(monkeypatch):
    from rollout_server.engines.vllm.fast_loader import FastLoader

    def oom(self, nbytes):
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")
    monkeypatch.setattr(FastLoader, "_ensure_buffers", oom)
    w = Worker()
    info = w.tandem_prepare(layout_of(hf_weights(1), bucket_bytes=600))
    assert not info["ok"] and not info["transient"], info
    assert "2 receive buffers of 0 MB" in info["reason"]  # 600-byte chunks here
    for key in ("weight_sync.bucket_mb", "rollout_server.gpu_memory_utilization",
                "rollout_server.weight_load: native"):
        assert key in info["reason"], info["reason"]
    assert w._tandem_fast_loader().plan is None  # nothing half-built is kept


# ------------------------------------------------------------------ the one-call path (plan already held)


def test_one_call_receive_plans_on_the_spot_and_reuses_the_plan():
    w = Worker()
    for seed, recorded in ((1, True), (2, False)):
        weights = hf_weights(seed)
        w.weight_transfer_engine.model_update_group = Group(stream(weights, 600)[1])
        out = w.tandem_receive(timeout_s=30, layout=layout_of(weights))
        assert out["path"] == "plan" and out["recorded"] is recorded, out
        same(w.weight_transfer_engine.model, native(weights))


def test_one_call_receive_replans_when_the_model_storage_moved():
    w = Worker()
    weights = hf_weights(1)
    w.weight_transfer_engine.model_update_group = Group(stream(weights, 600)[1])
    w.tandem_receive(timeout_s=30, layout=layout_of(weights))
    model = w.weight_transfer_engine.model
    model.qkv.data = model.qkv.data.clone()  # e.g. memory re-allocated between syncs
    weights = hf_weights(2)
    w.weight_transfer_engine.model_update_group = Group(stream(weights, 600)[1])
    out = w.tandem_receive(timeout_s=30, layout=layout_of(weights))
    assert out["path"] == "plan" and out["recorded"], out
    same(model, native(weights))


def test_one_call_receive_without_a_possible_plan_loads_through_the_loaders():
    """The learner is already broadcasting: the worker must take every chunk, and load them right."""
    w = Worker()
    w.weight_transfer_engine.model.mode = "item"  # reads received values: no plan possible
    weights = hf_weights(3)
    group = Group(stream(weights, 600)[1])
    w.weight_transfer_engine.model_update_group = group
    out = w.tandem_receive(timeout_s=30, layout=layout_of(weights))
    assert out["path"] == "direct" and "reads received values" in out["reason"], out
    assert next(group.chunks, None) is None, "every chunk must be consumed"
    same(w.weight_transfer_engine.model, native(weights, "item"))


def test_one_call_receive_with_reload_wrappers_drains_the_stream_and_raises():
    w = Worker()
    model = w.weight_transfer_engine.model
    before = {n: t.clone() for n, t in model.state_dict().items()}

    def online_process_loader(*a, **k):
        raise AssertionError("must not be called")
    model.qkv.weight_loader = online_process_loader
    weights = hf_weights(4)
    group = Group(stream(weights, 600)[1])
    w.weight_transfer_engine.model_update_group = group
    with pytest.raises(RuntimeError, match="drained"):
        w.tandem_receive(timeout_s=30, layout=layout_of(weights))
    assert next(group.chunks, None) is None, "the stream must be drained so the other ranks finish"
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n


def test_stream_key_names_the_stream_not_its_values():
    a, b = layout_of(hf_weights(1)), layout_of(hf_weights(2))
    assert stream_key(a) == stream_key(b)  # same names, shapes, dtypes, offsets, bucket size
    assert stream_key(a) != stream_key(layout_of(hf_weights(1), bucket_bytes=601))
    c = layout_of(hf_weights(1))
    c["names"] = list(reversed(c["names"]))
    assert stream_key(c) != stream_key(a)
