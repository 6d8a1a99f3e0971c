"""The fast load path's CUDA side (rollout_server.load_plan.FastLoader): receive stream + copy stream.

Chunks "arrive" by a device copy on the receive stream (what an NCCL broadcast does there); every
chunk is its own broadcast (bucket 1 byte), so both slots are reused several times and a missing
event between the streams would show as a wrong byte. Needs one GPU (``make test-gpu``).
"""

from __future__ import annotations

import pytest
import torch

from rollout_server.load_plan import FastLoader
from tests.test_load_plan import VllmLike, hf_weights, native, stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run `make test-gpu` on a GPU machine"),
]


@pytest.mark.parametrize("bucket_bytes", [1, 1 << 20])
def test_cuda_replay_equals_the_native_load_across_streams(bucket_bytes: int) -> None:
    model = VllmLike().cuda()
    loader = FastLoader(model, torch.device("cuda"))
    for seed in (1, 2, 3, 4):
        weights = hf_weights(seed)
        layouts, chunks = stream(weights, bucket_bytes)
        chunks = [c.cuda() for c in chunks]
        it = iter(chunks)

        def broadcast(buf, s):
            torch.cuda._sleep(200_000)  # a slow wire on the receive stream: copies must wait for it
            buf.copy_(next(it), non_blocking=True)
        loader.prepare(layouts)
        loader.receive(broadcast, deadline=float("inf"))
        want = native([(n, t) for n, t in weights])
        for (n, x), (_, y) in zip(model.state_dict().items(), want.state_dict().items()):
            assert torch.equal(x.cpu(), y), (seed, n)
