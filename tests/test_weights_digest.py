"""The exact weights digest: ``common.weight_sync.weights.exact_digest`` and ``GET /sync/digest``.

Unit tests pin the definition (every element, exact integers, order- and layout-aware, independent
of chunking); the end-to-end tests run a real hf server on loopback, push weights over HTTP with the
learner's client and check that the served digest is the local digest of what was pushed.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from common.wire.http import ErrorResponse
from common.weight_sync.messages import SyncDigestResponse
from common.weight_sync import weights as W
from rollout_server.app import build_app
from learner.weight_sync.base import cast_stream, plan
from learner.weight_sync.http import HttpWeightSender
from tests.server_proc import rollout_server_process
from tests.stub_engine import StubEngine

TOKEN = "digest-token"
DTYPES = [torch.bfloat16, torch.float32, torch.uint8]


def make(dtype: torch.dtype, shape=(37, 53), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


def digest(t: torch.Tensor, name: str = "w", **kw) -> str:
    return W.exact_digest([(name, t)], **kw)


def reference_sums(t: torch.Tensor) -> tuple[int, int]:
    """The definition in plain Python: raw bits as unsigned ints, plain and position-weighted sums."""
    size = t.element_size()
    raw = t.contiguous().reshape(-1).view(torch.uint8).tolist()
    s1 = s2 = 0
    for i in range(t.numel()):
        u = int.from_bytes(bytes(raw[i * size:(i + 1) * size]), "little")
        s1 += u
        s2 += u * (i % W.DIGEST_MODULUS + 1)
    return s1, s2


# ---------------------------------------------------------------------------------------------
# exact_digest
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_equal_tensors_give_equal_digests_whatever_the_input_order(dtype):
    a, b = make(dtype, seed=1), make(dtype, (8,), seed=2)
    assert W.exact_digest([("a", a), ("b", b)]) == W.exact_digest([("b", b.clone()), ("a", a.clone())])
    assert len(digest(a)) == 16 and int(digest(a), 16) >= 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_changing_one_element_by_one_bit_changes_the_digest(dtype):
    t = make(dtype)
    before = digest(t)
    for index in (0, 1, t.numel() // 2, t.numel() - 1):
        bits = t.clone().reshape(-1).view(W._BITS_AS[t.element_size()])
        bits[index] ^= 1  # the lowest mantissa bit: a change the sampled fingerprint may not see
        changed = bits.view(dtype).reshape(t.shape)
        assert digest(changed) != before, index


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swapping_two_elements_changes_the_digest(dtype):
    t = make(dtype)
    flat = t.clone().reshape(-1)
    i, j = 3, flat.numel() - 5
    assert flat[i] != flat[j]
    flat[[i, j]] = flat[[j, i]]
    assert digest(flat.reshape(t.shape)) != digest(t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_non_contiguous_view_digests_like_a_contiguous_copy_of_its_values(dtype):
    base = make(dtype, (40, 64), seed=3)
    for view in (base.t(), base[:, ::3], base[::2, 1:]):
        assert not view.is_contiguous()
        want = digest(view.contiguous())
        assert digest(view) == want
        assert digest(view, chunk_elems=7) == want  # walked in bounded blocks, rows split


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16, torch.float64, torch.int64, torch.int32], ids=str)
def test_the_sums_are_exact_and_do_not_depend_on_the_chunk_size(dtype):
    t = make(dtype, (70001,), seed=4) if dtype not in (torch.int64, torch.int32) else \
        torch.tensor([torch.iinfo(dtype).min, torch.iinfo(dtype).max, -1, 0, 12345], dtype=dtype)
    assert W._exact_sums(t, W.DIGEST_CHUNK) == reference_sums(t)
    assert {digest(t, chunk_elems=c) for c in (1, 13, 4096, W.DIGEST_CHUNK)} == {digest(t)}


def test_position_weights_cycle_past_the_modulus_and_big_values_do_not_overflow():
    t = torch.full((W.DIGEST_MODULUS + 10,), -1, dtype=torch.int64)  # all 64 bits set: u = 2**64 - 1
    assert W._exact_sums(t, 1000) == reference_sums(t)


def test_name_dtype_and_shape_are_part_of_the_digest():
    t = make(torch.float32)
    assert digest(t, "a") != digest(t, "b")
    assert digest(t) != digest(t.to(torch.float64))
    assert digest(t) != digest(t.reshape(53, 37))
    assert digest(t.to(torch.bfloat16)) != digest(t)


def test_inputs_are_left_untouched_and_parameters_are_accepted():
    p = torch.nn.Parameter(make(torch.float32))
    copy = p.detach().clone()
    d = W.exact_digest([("p", p)])
    assert torch.equal(p.detach(), copy) and p.requires_grad and p.dtype == torch.float32
    assert d == digest(copy, "p")


def test_scalars_and_empty_tensors_digest_and_bad_chunk_sizes_are_refused():
    assert digest(torch.tensor(2.5)) != digest(torch.tensor(3.5))
    assert digest(torch.zeros(0, 3)) != digest(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="chunk_elems"):
        digest(torch.zeros(3), chunk_elems=0)


# ---------------------------------------------------------------------------------------------
# GET /sync/digest without an engine digest: 501 (in process, no model)
# ---------------------------------------------------------------------------------------------


def test_an_engine_without_a_digest_answers_501_naming_it():
    cfg = SimpleNamespace(sync_idle_timeout_s=30.0, auth_token=None, max_batch_items=4, admission_timeout_s=5.0,
                          max_bucket_mb=16)
    with TestClient(build_app(StubEngine("m"), cfg, engine_started=True)) as client:
        r = client.get("/sync/digest")
    assert r.status_code == 501, r.text
    err = ErrorResponse.model_validate_json(r.content)
    assert err.error == "not_implemented" and "stub engine" in err.message


# ---------------------------------------------------------------------------------------------
# GET /sync/digest on a real hf server
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """(server, sync client, the init info, the checkpoint's weights as the learner holds them)."""
    from transformers import AutoModelForImageTextToText

    from learner.weight_sync.served import named_weights

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base = {n: t.clone() for n, t in named_weights(model)}
    with rollout_server_process(tiny_model_dir, [f"rollout_server.auth_token={TOKEN}"]) as srv:
        client = HttpWeightSender(srv.url, auth_token=TOKEN, timeout_s=60, client_id="digest-test")
        session = client.open()
        session.abort("only the manifest was wanted")
        yield SimpleNamespace(srv=srv, client=client, info=session.info, base=base)
        client.close()


def get_digest(srv, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(srv.url + "/sync/digest", headers=headers, timeout=60)


def served_digest(srv) -> SyncDigestResponse:
    r = get_digest(srv)
    assert r.status_code == 200, r.text
    return SyncDigestResponse.model_validate_json(r.content)


def local_digest(served, weights: dict[str, torch.Tensor]) -> str:
    """exact_digest of exactly what a push sends: planned in manifest order, cast to the serving dtype."""
    planned = plan(served.info, weights.items())
    return W.exact_digest(cast_stream(served.info, planned))


@pytest.mark.slow
def test_the_digest_route_needs_the_bearer_token(served):
    for token in (None, "wrong"):
        r = get_digest(served.srv, token)
        assert r.status_code == 401, r.text
        assert ErrorResponse.model_validate_json(r.content).error == "unauthorized"


@pytest.mark.slow
def test_the_served_digest_follows_pushes_and_equals_the_local_digest_of_the_pushed_tensors(served):
    first = served_digest(served.srv)
    assert first.engine == "hf" and len(first.digests) == 1
    assert first.digests[0] == local_digest(served, served.base)  # loaded from disk == loaded here

    g = torch.Generator().manual_seed(7)
    perturbed = {n: t + 0.01 * torch.randn(t.shape, generator=g) if t.dim() == 2 else t.clone()
                 for n, t in served.base.items()}
    report = served.client.push(perturbed.items(), bucket_bytes=1 << 20)
    after = served_digest(served.srv)
    assert after.ver == report.ver == first.ver + 1
    assert after.digests[0] != first.digests[0]
    assert after.digests[0] == local_digest(served, perturbed)

    # One element the sampled fingerprint never reads: the fingerprint stays, the exact digest moves.
    name = max(perturbed, key=lambda n: perturbed[n].numel())
    n = perturbed[name].numel()
    sampled = set((torch.arange(W.FINGERPRINT_SAMPLES) * (n - 1) // (W.FINGERPRINT_SAMPLES - 1)).tolist())
    index = next(i for i in range(n) if i not in sampled)
    nudged = dict(perturbed)
    nudged[name] = perturbed[name].clone()
    nudged[name].view(-1)[index] += 1.0
    report2 = served.client.push(nudged.items(), bucket_bytes=1 << 20)
    assert report2.fingerprint == report.fingerprint
    nudged_digest = served_digest(served.srv)
    assert nudged_digest.digests[0] != after.digests[0]
    assert nudged_digest.digests[0] == local_digest(served, nudged)

    served.client.push(served.base.items(), bucket_bytes=1 << 20)  # back to the checkpoint
    back = served_digest(served.srv)
    assert back.ver == first.ver + 3 and back.digests == first.digests


@pytest.mark.slow
def test_the_digest_is_refused_with_409_while_a_sync_session_is_open(served):
    before = served_digest(served.srv)
    session = served.client.open()
    try:
        for step in ("open", "fenced"):
            r = get_digest(served.srv)
            assert r.status_code == 409, r.text
            err = ErrorResponse.model_validate_json(r.content)
            assert err.error == "sync_state" and session.id in err.message and step in err.message
            assert "retry" in (err.hint or "")
            if step == "open":
                session.begin("drain")
    finally:
        assert session.abort("test done").aborted
    assert served_digest(served.srv) == before  # aborted: same weights, same ver
