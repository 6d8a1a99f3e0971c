"""The fast load path's CUDA side (rollout_server.engines.vllm.fast_loader.FastLoader): receive stream + copy stream.

Chunks "arrive" by a device copy on the receive stream (what an NCCL broadcast does there); every
chunk is its own broadcast (bucket 1 byte), so both slots are reused several times and a missing
event between the streams would show as a wrong byte. Needs one GPU (``make test-gpu``).
"""

from __future__ import annotations

import pytest
import torch

from rollout_server.engines.vllm.fast_loader import FastLoader
from tests.test_load_plan import VllmLike, hf_weights, native, stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run `make test-gpu` on a GPU machine"),
]


def _slow_wire(chunks):
    it = iter([c.cuda() for c in chunks])

    def broadcast(buf, s):
        torch.cuda._sleep(200_000)  # a slow wire on the receive stream: copies must wait for it
        buf.copy_(next(it), non_blocking=True)
    return broadcast


def _same_as_native(model, weights, mode, tag):
    want = native([(n, t) for n, t in weights], mode)
    for (n, x), (_, y) in zip(model.state_dict().items(), want.state_dict().items()):
        assert torch.equal(x.cpu(), y), (tag, n)


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("mode", ["pure", "scaled", "staged"])  # copies only; a compute step; a scratch copy
@pytest.mark.parametrize("bucket_bytes", [1, 1 << 20])
def test_cuda_replay_equals_the_native_load_across_streams(bucket_bytes: int, mode: str, graphs: bool) -> None:
    model = VllmLike(mode).cuda()
    loader = FastLoader(model, torch.device("cuda"))
    loader.use_graphs = graphs
    for seed in (1, 2, 3, 4):
        weights = hf_weights(seed)
        layouts, chunks = stream(weights, bucket_bytes)
        info = loader.prepare(layouts)
        assert info["graphs"].startswith("cuda graphs" if graphs else "eager"), info["graphs"]
        out = loader.receive(_slow_wire(chunks), deadline=float("inf"))
        assert out["gpu_s"] > 0 and out["issue_s"] <= out["receive_s"]
        _same_as_native(model, weights, mode, seed)


def test_cuda_direct_receive_loads_through_the_loader() -> None:
    model = VllmLike("item").cuda()
    loader = FastLoader(model, torch.device("cuda"))
    weights = hf_weights(5)
    layouts, chunks = stream(weights, 600)
    loader.receive_direct(layouts, _slow_wire(chunks), deadline=float("inf"))
    _same_as_native(model, weights, "item", "direct")
