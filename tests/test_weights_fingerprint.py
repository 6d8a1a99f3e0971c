"""``common.weight_sync.weights.fingerprint``: the sampled weights hash both sides of a sync compare.

Its definition is pinned by a tensor-by-tensor reference (the hashed bytes must not change: a
learner and a server of different tandem versions compare fingerprints), and its sensitivity by
changes it must and must not see.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from common.weight_sync import weights as W


def reference(named, dtypes=None) -> str:
    """The definition, one tensor at a time (what fingerprint() computed before it batched the copies)."""
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(named, key=lambda kv: kv[0]):
        flat = t.detach().reshape(-1)
        n = flat.numel()
        if n > W.FINGERPRINT_SAMPLES:
            idx = torch.arange(W.FINGERPRINT_SAMPLES) * (n - 1) // (W.FINGERPRINT_SAMPLES - 1)
            flat = flat[idx]
        dtype = dtypes.get(name) if dtypes else None
        if dtype is not None and t.is_floating_point():
            flat = flat.to(W.torch_dtype(dtype))
        h.update(f"{name}|{W.dtype_name(flat.dtype)}|{list(t.shape)}|".encode())
        h.update(flat.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [("b.big", torch.randn(300, 70, generator=g)),            # > FINGERPRINT_SAMPLES: sampled
            ("a.small", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
            ("c.same_size", torch.randn(300, 70, generator=g)),      # shares the sample index with b.big
            ("d.ids", torch.randint(0, 9, (4097,), generator=g)),    # int64, sampled
            ("e.mask", torch.rand(7, generator=g) > 0.5),            # bool
            ("f.scalar", torch.tensor(3.5)),                          # 0-d
            ("g.empty", torch.zeros(0, 4))]


@pytest.mark.parametrize("dtypes", [None, {"b.big": "bfloat16", "a.small": "float32", "d.ids": "bfloat16"}])
def test_fingerprint_equals_the_tensor_by_tensor_definition(dtypes):
    named = weights()
    assert W.fingerprint(named, dtypes) == reference(named, dtypes)
    assert W.fingerprint(list(reversed(named)), dtypes) == reference(named, dtypes)  # order-independent


def test_fingerprint_sees_sampled_changes_names_and_shapes():
    named = weights()
    base = W.fingerprint(named)
    assert W.fingerprint(weights(seed=1)) != base
    changed = [(n, t.clone()) for n, t in named]
    changed[0][1].view(-1)[0] += 1  # element 0 is always sampled
    assert W.fingerprint(changed) != base
    renamed = [("z" + n if i == 1 else n, t) for i, (n, t) in enumerate(named)]
    assert W.fingerprint(renamed) != base
    reshaped = [(n, t.reshape(70, 300) if n == "b.big" else t) for n, t in named]
    assert W.fingerprint(reshaped) != base
