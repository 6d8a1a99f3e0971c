"""Bad input gets a 4xx naming the problem, and the server keeps serving (checked after each)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from common.protocol import BUCKET_HEADER, ErrorResponse, SyncBucketHeader
from common.tensors import weights as W
from learner.sync import SyncError
from learner.sync.http import HttpWeightSender
from tests.ports import free_port_block
from tests.server_proc import rollout_server_process

pytestmark = pytest.mark.slow

TOKEN = "test-token"
MAX_ITEMS = 4
GOOD_ITEM = {"prompt_token_ids": [1, 2, 3]}
GOOD = {"items": [GOOD_ITEM], "sampling": {"max_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with rollout_server_process(tiny_model_dir, [f"rollout_server.auth_token={TOKEN}",
                                                 f"rollout_server.max_batch_items={MAX_ITEMS}"]) as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(30.0, connect=5.0)) as c:
        yield c
    # after every test: still healthy and still serving
    with httpx.Client(base_url=server.url, timeout=30.0) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/infer", json=GOOD)
        assert r.status_code == 200, r.text


def admin(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def error_of(r: httpx.Response, status: int) -> ErrorResponse:
    assert r.status_code == status, (r.status_code, r.text)
    return ErrorResponse.model_validate_json(r.content)


BAD_INFER = [
    pytest.param(b'{"items": [{"prompt_token_ids": [1, 2', 400, "body", "malformed JSON", id="malformed-json"),
    pytest.param(b"[1, 2, 3]", 422, "body", "", id="not-an-object"),
    pytest.param({**GOOD, "temperatur": 0.5}, 422, "temperatur", "Extra inputs", id="unknown-top-level-field"),
    pytest.param({"items": [{**GOOD_ITEM, "imgs": []}], "sampling": GOOD["sampling"]}, 422, "items.0.imgs",
                 "Extra inputs", id="unknown-item-field"),
    pytest.param({"items": [GOOD_ITEM], "sampling": {"max_tokens": "many"}}, 422, "sampling.max_tokens",
                 "integer", id="wrong-type"),
    pytest.param({"items": [GOOD_ITEM], "sampling": {"max_tokens": 10**9}}, 422, "sampling.max_tokens",
                 "less than or equal", id="absurd-max-tokens"),
    pytest.param({"items": [GOOD_ITEM], "sampling": {"temperature": 0}}, 422, "sampling.max_tokens", "required",
                 id="missing-max-tokens"),
    pytest.param({"items": [GOOD_ITEM], "sampling": {"max_tokens": 2, "top_p": 0}}, 422, "sampling.top_p",
                 "greater than 0", id="zero-top-p"),
    pytest.param({"items": [], "sampling": GOOD["sampling"]}, 422, "items", "at least 1", id="no-items"),
    pytest.param({"items": [{"messages": [{"role": "user", "content": "x"}], "prompt_token_ids": [1]}],
                  "sampling": GOOD["sampling"]}, 422, "items.0", "exactly one", id="two-prompts"),
    pytest.param({"items": [{"messages": [{"role": "user", "content": [{"type": "image"}]}]}],
                  "sampling": GOOD["sampling"]}, 422, "items.0", "image parts", id="image-slot-without-image"),
    pytest.param({"items": [{"prompt_token_ids": [1], "images": ["data:text/plain;base64,aGk="]}],
                  "sampling": GOOD["sampling"]}, 422, "items.0.images", "data URI", id="non-image-data-uri"),
    pytest.param({"items": [{"messages": [{"role": "user", "content": [{"type": "image"}]}],
                             "images": ["/nonexistent/picture.png"]}], "sampling": GOOD["sampling"]},
                 400, "items.0.images.0", "not found", id="missing-image-file"),
    pytest.param({"items": [{"messages": [{"role": "user", "content": [{"type": "image"}]}],
                             "images": ["data:image/png;base64,bm90IGEgcG5n"]}], "sampling": GOOD["sampling"]},
                 400, "items.0.images.0", "cannot be decoded", id="corrupt-image"),
    pytest.param({"items": [{"prompt_token_ids": [1, 10**7]}], "sampling": GOOD["sampling"]}, 400,
                 "items.0.prompt_token_ids", "outside the vocabulary", id="token-id-outside-vocab"),
    pytest.param({"items": [GOOD_ITEM] * (MAX_ITEMS + 1), "sampling": GOOD["sampling"]}, 413, "items",
                 "max_batch_items", id="batch-over-the-limit"),
    pytest.param({"items": [GOOD_ITEM], "sampling": GOOD["sampling"], "min_ver": -1}, 422, "min_ver",
                 "greater than or equal", id="negative-min-ver"),
]


@pytest.mark.parametrize("body, status, field, words", BAD_INFER)
def test_bad_infer_requests_get_a_4xx_naming_the_field(http, body, status, field, words):
    if isinstance(body, bytes):
        r = http.post("/infer", content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post("/infer", json=body)
    err = error_of(r, status)
    assert err.error == "bad_request" and err.field == field, err
    assert words in err.message, err.message


def test_an_unknown_route_and_a_wrong_method_get_an_error_body(http):
    assert error_of(http.get("/nope"), 404).error == "bad_request"
    assert "/infer" in error_of(http.get("/infer"), 405).message


@pytest.mark.parametrize("headers, words", [({}, "none given"), (admin("wrong"), "wrong"),
                                            ({"Authorization": f"Basic {TOKEN}"}, "wrong")])
def test_sync_routes_without_the_right_bearer_token_get_401(http, headers, words):
    for path in ("/sync/init", "/sync/begin", "/sync/bucket", "/sync/commit", "/sync/abort"):
        err = error_of(http.post(path, json={}, headers=headers), 401)
        assert err.error == "unauthorized" and err.field == "Authorization" and words in err.message


def test_a_second_concurrent_sync_client_gets_409_naming_the_holder(server, http):
    first = HttpWeightSender(server.url, auth_token=TOKEN, client_id="learner-A", timeout_s=30)
    session = first.open()
    try:
        with pytest.raises(SyncError) as info:
            HttpWeightSender(server.url, auth_token=TOKEN, client_id="learner-B", timeout_s=30).open()
        assert info.value.status == 409 and "learner-A" in str(info.value) and session.id in str(info.value)
        err = error_of(http.post("/sync/abort", json={"session": "s-other"}, headers=admin()), 409)
        assert err.error == "sync_conflict"  # nobody else may end the holder's session
    finally:
        assert session.abort("test done").aborted


def test_sync_calls_out_of_order_get_409_and_unknown_sessions_are_named(server, http):
    r = http.post("/sync/commit", json={"session": "s-nope", "n_buckets": 0}, headers=admin())
    assert error_of(r, 409).error == "sync_state" and "s-nope" in r.json()["message"]
    assert http.post("/sync/abort", json={"session": "s-nope"}, headers=admin()).json()["aborted"] is False
    session = HttpWeightSender(server.url, auth_token=TOKEN, timeout_s=30).open()
    r = http.post("/sync/commit", json={"session": session.id, "n_buckets": 0}, headers=admin())
    assert error_of(r, 409).error == "sync_state" and "open" in r.json()["message"]  # commit before begin
    session.abort("test done")


def test_a_collective_init_with_a_backend_the_engine_cannot_join_is_refused_at_once(http):
    body = {"client": "x", "transport": "nccl", "master_addr": "127.0.0.1", "master_port": free_port_block(1),
            "world_size": 2, "timeout_s": 30}  # backend defaults to nccl: a GPU learner; this server is on CPU
    err = error_of(http.post("/sync/init", json=body, headers=admin()), 400)
    assert err.field == "backend" and "gloo" in err.message and "CPU" in err.message


def test_a_collective_init_nobody_joins_fails_within_its_deadline_and_leaves_no_session(server, http):
    port = free_port_block(1)  # no learner hosts this rendezvous
    body = {"client": "x", "transport": "nccl", "master_addr": "127.0.0.1", "master_port": port, "world_size": 2,
            "backend": "gloo", "timeout_s": 2}
    t0 = time.monotonic()
    r = http.post("/sync/init", json=body, headers=admin())
    assert time.monotonic() - t0 < 60, "the init must give up at its own deadline (2 s), not hang"
    assert r.status_code in (500, 504), r.text
    assert f"127.0.0.1:{port}" in r.json()["message"]
    session = HttpWeightSender(server.url, auth_token=TOKEN, timeout_s=30).open()  # the server took no harm
    session.abort("test done")
    assert http.get("/health").status_code == 200


def _begun_session(server):
    session = HttpWeightSender(server.url, auth_token=TOKEN, timeout_s=30).open()
    session.begin("drain")
    return session


def _post_bucket(http, session_id: str, tensors: dict[str, torch.Tensor], index: int = 0, header_patch=None):
    blob, layout = W.encode_bucket(tensors)
    header = {"session": session_id, "index": index, "names": [e[0] for e in layout],
              "dtypes": [e[1] for e in layout], "shapes": [e[2] for e in layout], "offsets": [e[3] for e in layout]}
    header.update(header_patch or {})
    return http.post("/sync/bucket", content=blob,
                     headers={**admin(), BUCKET_HEADER: json.dumps(header), "Content-Type": "application/octet-stream"})


def test_a_wrong_shaped_bucket_gets_400_naming_the_tensor_and_the_old_weights_stay(server, http):
    ver = http.get("/health").json()["ver"]
    session = _begun_session(server)
    spec = session.info.manifest[0]
    wrong = torch.zeros([d + 1 for d in spec.shape], dtype=getattr(torch, spec.dtype))
    err = error_of(_post_bucket(http, session.id, {spec.name: wrong}), 400)
    assert err.field == f"names.{spec.name}" and "shape" in err.message and str(spec.shape) in err.message
    assert "old weights kept" in err.message
    health = http.get("/health").json()
    assert (health["ver"], health["sync_state"], health["status"]) == (ver, "idle", "ok")  # session ended, fence open


@pytest.mark.parametrize("case", ["unknown-name", "wrong-dtype", "header-disagrees-with-body", "not-safetensors",
                                  "out-of-order-index", "missing-header"])
def test_a_malformed_bucket_gets_a_4xx_naming_the_problem(server, http, case):
    session = _begun_session(server)
    spec = session.info.manifest[0]
    good = torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype))
    if case == "unknown-name":
        err = error_of(_post_bucket(http, session.id, {"model.not_a_layer.weight": good}), 400)
        assert "not a parameter of the served model" in err.message
    elif case == "wrong-dtype":
        err = error_of(_post_bucket(http, session.id, {spec.name: good.to(torch.float16)}), 400)
        assert "float16" in err.message and "cast on the learner" in err.message
    elif case == "header-disagrees-with-body":
        other = torch.zeros([2, 2], dtype=good.dtype)
        r = _post_bucket(http, session.id, {spec.name: good},
                         header_patch={"shapes": [[2, 2]], "offsets": [[0, other.numel() * other.element_size()]]})
        err = error_of(r, 400)
        assert err.field == "body" and "declares" in err.message
    elif case == "not-safetensors":
        r = http.post("/sync/bucket", content=b"\x00" * 3, headers={
            **admin(), "Content-Type": "application/octet-stream",
            BUCKET_HEADER: SyncBucketHeader(session=session.id, index=0, names=["x"], dtypes=["uint8"], shapes=[[3]],
                                            offsets=[(0, 3)]).model_dump_json()})
        err = error_of(r, 400)
        assert "safetensors" in err.message
    elif case == "out-of-order-index":
        err = error_of(_post_bucket(http, session.id, {spec.name: good}, index=3), 409)
        assert err.field == "index" and "expected 0" in err.message
    else:
        r = http.post("/sync/bucket", content=b"", headers=admin())
        err = error_of(r, 400)
        assert err.field == BUCKET_HEADER
        session.abort("test done")
    assert http.get("/health").json()["sync_state"] == "idle"
