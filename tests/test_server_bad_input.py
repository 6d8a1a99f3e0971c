"""Bad input gets a 4xx naming the problem, and the server keeps serving (checked after each).

One server for the module, with small limits so that every limit is cheap to hit: bodies (1 MB,
2 MB buckets, 2 s read gap), images (2 megapixels each, 1 per request), tokens (16384 per request), 4 items.
"""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import struct
import time
import zlib
from collections.abc import Iterable

import httpx
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from common.weight_sync.messages import BUCKET_HEADER, SyncBucketHeader
from common.wire.http import ErrorResponse
from common.weight_sync import packed as P
from common.weight_sync import weights as W
from learner.weight_sync.session import SyncError
from learner.weight_sync.http import HttpWeightSender
from tests.ports import free_port_block
from tests.server_proc import rollout_server_process

pytestmark = pytest.mark.slow

TOKEN = "test-token"
MAX_ITEMS = 4
READ_GAP_S = 2.0
TOKEN_BUDGET = 16384
GOOD_ITEM = {"prompt_token_ids": [1, 2, 3]}
GOOD = {"items": [GOOD_ITEM], "sampling": {"max_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with rollout_server_process(tiny_model_dir, [
            f"rollout_server.auth_token={TOKEN}", f"rollout_server.max_batch_items={MAX_ITEMS}",
            "rollout_server.max_request_mb=1", "rollout_server.max_bucket_mb=2", "weight_sync.bucket_mb=2",
            f"rollout_server.body_read_timeout_s={READ_GAP_S}", "rollout_server.max_request_megapixels=1",
            "rollout_server.max_image_megapixels=2",
            f"rollout_server.max_request_tokens={TOKEN_BUDGET}"]) as srv:
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
                  "sampling": GOOD["sampling"]}, 400, "items.0", "image parts", id="image-slot-without-image"),
    pytest.param({"items": [{"prompt_token_ids": [1], "images": ["data:text/plain;base64,aGk="]}],
                  "sampling": GOOD["sampling"]}, 400, "items.0.images", "data URI", id="non-image-data-uri"),  # fits the schema
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
    # values the schema took and the engine could not (a 500 before), or that never come back (a hang)
    pytest.param({"items": [GOOD_ITEM], "sampling": GOOD["sampling"], "min_ver": 2**64}, 422, "min_ver",
                 "less than or equal", id="min-ver-past-int64"),
    pytest.param({"items": [GOOD_ITEM], "sampling": GOOD["sampling"], "min_ver": 2**31}, 400, "min_ver",
                 "one commit moves ver", id="min-ver-no-commit-can-reach"),  # fits the schema: a 400
    pytest.param({"items": [GOOD_ITEM], "sampling": {"max_tokens": 2, "seed": 2**64}}, 422, "sampling.seed",
                 "less than or equal", id="seed-past-64-bits"),
    pytest.param({"items": [GOOD_ITEM], "sampling": {"max_tokens": 2, "seed": -1}}, 422, "sampling.seed",
                 "greater than or equal", id="negative-seed"),
    pytest.param({"items": [GOOD_ITEM], "sampling": {"max_tokens": 2, "repetition_penalty": 1e-30}}, 422,
                 "sampling.repetition_penalty", "greater than or equal", id="degenerate-repetition-penalty"),
    pytest.param({"items": [GOOD_ITEM], "sampling": {"max_tokens": 2, "top_k": 2**40}}, 422, "sampling.top_k",
                 "less than or equal", id="top-k-past-int32"),
    pytest.param({"items": [GOOD_ITEM], "sampling": {"max_tokens": 2, "stop": [""]}}, 422, "sampling.stop.0",
                 "at least 1 character", id="empty-stop-string"),
    pytest.param({"items": [{"prompt_token_ids": [1, -1]}], "sampling": GOOD["sampling"]}, 422,
                 "items.0.prompt_token_ids.1", "greater than or equal", id="negative-token-id"),
    # budgets: a 413 naming the limit (clients split a 413'd batch)
    pytest.param({"items": [GOOD_ITEM] * 2, "sampling": {"max_tokens": TOKEN_BUDGET // 2}}, 413,
                 "sampling.max_tokens", "rollout_server.max_request_tokens", id="over-the-token-budget"),
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
    layout = P.packed_layout(list(tensors.items()), {n: W.dtype_name(t.dtype) for n, t in tensors.items()})
    buf = torch.empty(P.nbytes_of(layout), dtype=torch.uint8)
    P.pack_into(buf, list(tensors.values()), layout)
    blob = buf.numpy().tobytes()
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


@pytest.mark.parametrize("case", ["unknown-name", "wrong-dtype", "header-disagrees-with-body", "trailing-bytes",
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
        assert err.field == "body" and "the body has" in err.message
    elif case == "trailing-bytes":  # bytes past the last declared tensor are refused, not ignored
        r = http.post("/sync/bucket", content=b"\x00" * 5, headers={
            **admin(), "Content-Type": "application/octet-stream",
            BUCKET_HEADER: SyncBucketHeader(session=session.id, index=0, names=[spec.name], dtypes=["uint8"],
                                            shapes=[[3]], offsets=[(0, 3)]).model_dump_json()})
        err = error_of(r, 400)
        assert err.field == "body" and "end at byte 3" in err.message and "5 bytes" in err.message
    elif case == "out-of-order-index":
        err = error_of(_post_bucket(http, session.id, {spec.name: good}, index=3), 409)
        assert err.field == "index" and "expected 0" in err.message
    else:
        r = http.post("/sync/bucket", content=b"", headers=admin())
        err = error_of(r, 400)
        assert err.field == BUCKET_HEADER
        session.abort("test done")
    assert http.get("/health").json()["sync_state"] == "idle"


# ---------------------------------------------------------------------------------------------
# The trust boundary (rollout_server/guard.py): token before body, size caps whatever the framing,
# read deadlines, pixel budgets, min_ver bounds, disconnects cancel generation
# ---------------------------------------------------------------------------------------------


def raw_http(port: int, head: str, parts: Iterable[bytes] = (), *, timeout_s: float = 15.0) -> tuple[int, dict]:
    """Send ``head`` (request line + headers, no blank line) then ``parts`` over a raw socket, and read
    the response: (status, JSON body). The server may answer (and close) before every part is sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n")
        try:
            for part in parts:
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered before the body ended
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed without a response (got {data!r})")
            data += chunk
        head_bytes, _, body = data.partition(b"\r\n\r\n")
        status = int(head_bytes.split()[1])
        length = int(re.search(rb"(?i)content-length: *(\d+)", head_bytes).group(1))
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    return status, json.loads(body[:length])


def chunked(parts: Iterable[bytes]) -> Iterable[bytes]:
    for p in parts:
        yield b"%x\r\n%s\r\n" % (len(p), p)


def metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_sync_routes_refuse_a_wrong_token_before_reading_the_body(server):
    # 300 MB announced, 4 bytes sent: the 401 must come without the server waiting for (or parsing) the rest
    for auth in ("", "Authorization: Bearer wrong\r\n"):
        status, body = raw_http(server.port, f"POST /sync/init HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: "
                                f"application/json\r\nContent-Length: {300 << 20}", [b'{"a"'])
        assert status == 401 and body["error"] == "unauthorized", body


def test_a_chunked_body_over_the_cap_is_refused_as_it_arrives(server):
    # No Content-Length to check: the cap counts bytes as they arrive (max_request_mb = 1)
    status, body = raw_http(server.port, "POST /infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            "Transfer-Encoding: chunked", chunked([b"[" + b" " * 65535] * 64 + [b""]))
    assert status == 413 and "rollout_server.max_request_mb" in body["message"], body


def test_a_bucket_for_a_session_that_is_not_open_is_refused_before_its_body_is_read(server):
    header = SyncBucketHeader(session="s-none", index=0, names=["x"], dtypes=["uint8"], shapes=[[1 << 30]],
                              offsets=[(0, 1 << 30)]).model_dump_json()
    status, body = raw_http(server.port, f"POST /sync/bucket HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                            f"{BUCKET_HEADER}: {header}\r\nTransfer-Encoding: chunked", chunked([b"\0" * 1024]))
    assert status == 409 and body["error"] == "sync_state" and "s-none" in body["message"], body


def test_a_chunked_bucket_over_max_bucket_mb_ends_its_session_with_the_old_weights(server, http):
    ver = http.get("/health").json()["ver"]
    session = _begun_session(server)
    header = SyncBucketHeader(session=session.id, index=0, names=["x"], dtypes=["uint8"], shapes=[[3 << 20]],
                              offsets=[(0, 3 << 20)]).model_dump_json()
    status, body = raw_http(server.port, f"POST /sync/bucket HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                            f"{BUCKET_HEADER}: {header}\r\nTransfer-Encoding: chunked",
                            chunked([b"\0" * 65536] * 48 + [b""]))
    assert status == 413 and "rollout_server.max_bucket_mb" in body["message"], body
    assert "old weights kept" in body["message"], body
    health = http.get("/health").json()
    assert (health["ver"], health["sync_state"], health["status"]) == (ver, "idle", "ok")


def test_a_body_that_stops_arriving_is_a_408_within_the_read_deadline(server):
    status, body = raw_http(server.port, "POST /infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            "Content-Length: 100", [b'{"items": '], timeout_s=READ_GAP_S + 10)
    assert status == 408 and body["error"] == "request_timeout" and "10 bytes" in body["message"], body


def test_commit_min_ver_out_of_range_is_refused_and_ver_stays(server, http):
    ver = http.get("/health").json()["ver"]
    session = _begun_session(server)
    r = http.post("/sync/commit", json={"session": session.id, "n_buckets": 0, "min_ver": 10**30}, headers=admin())
    err = error_of(r, 422)  # fails validation: the session ends with it (issue 29), the fence reopens
    assert err.field == "min_ver" and "sync session aborted" in err.message
    assert http.get("/health").json()["sync_state"] == "idle"
    from common.weight_sync.messages import MAX_VER_JUMP

    session = _begun_session(server)

    with pytest.raises(SyncError) as info:  # schema-valid, but further above ver than any real resume
        session.commit(min_ver=ver + MAX_VER_JUMP + 1)
    assert info.value.status == 400 and "min_ver" in str(info.value) and "old weights kept" in str(info.value)
    health = http.get("/health").json()
    assert (health["ver"], health["sync_state"], health["status"]) == (ver, "idle", "ok")


def png_data_uri(width: int, height: int, *, header_only: bool = False) -> str:
    """A PNG data URI; ``header_only``: the header of a ``width`` x ``height`` RGB image and 16 bytes of
    pixels (a bomb's shape: PIL learns the size from the header, decoding would need width x height x 3 bytes)."""
    if header_only:
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        raw = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
               + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))
    else:
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (width, height)).save(buf, format="PNG")
        raw = buf.getvalue()
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.mark.parametrize("images, field, limit", [
    ([(800, 750, False)] * 2, "items.0.images.1", "rollout_server.max_request_megapixels = 1"),  # 0.6 MP each
    ([(2000, 1500, True)], "items.0.images.0", "rollout_server.max_image_megapixels = 2"),
    ([(20000, 20000, True)], "items.0.images.0", "decompression bomb"),  # 400 MP: refused by its header
], ids=["request-over-its-pixel-budget", "image-over-the-per-image-limit", "400-megapixel-bomb"])
def test_images_over_a_pixel_limit_are_a_413_naming_it_before_decoding(http, images, field, limit):
    item = {"messages": [{"role": "user", "content": [*[{"type": "image"}] * len(images), {"type": "text", "text": "hi"}]}],
            "images": [png_data_uri(w, h, header_only=header_only) for w, h, header_only in images]}
    err = error_of(http.post("/infer", json={"items": [item], "sampling": GOOD["sampling"]}), 413)
    assert err.field == field and limit in err.message, err


def test_a_client_that_disconnects_cancels_its_generation(server, http):
    cancelled = 'rollout_cancelled_total{reason="client_disconnect"}'
    before, tokens_before = metric(http, cancelled), metric(http, "rollout_generated_tokens_total")
    # ~12000 tokens to generate (tens of seconds on CPU); the client gives up after 1.5 s
    long = {"items": [{"prompt_token_ids": [5 + i, 6 + i, 7 + i]} for i in range(MAX_ITEMS)],
            "sampling": {"max_tokens": 3000, "temperature": 1.0, "seed": 0}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/infer", json=long, timeout=httpx.Timeout(1.5, connect=5.0))
    deadline = time.monotonic() + 60
    while metric(http, cancelled) < before + 1:
        assert time.monotonic() < deadline, "the server never cancelled the abandoned generation:\n" + server.log_tail()
        time.sleep(0.1)
    r = http.post("/infer", json=GOOD)
    assert r.status_code == 200, r.text
    # the abandoned batch's tokens were generated too (and counted), besides the short request's
    assert metric(http, "rollout_generated_tokens_total") - tokens_before > len(r.json()["outputs"][0]["token_ids"])


# ---------------------------------------------------------------------------------------------
# Property: whatever a client sends to any route, the server answers without a 5xx and without
# hanging. Cases are valid bodies of every route with mutations: first, as explicit examples, every
# leaf of every body set in turn to each edge value of its kind (2**64, -0.0, 1e300, "", None, ...)
# -- one bad value at a time is what reaches an engine, a second would already be a 422 -- then
# FUZZ_EXAMPLES random cases (1-3 mutations, raw junk, GETs), fixed seed. A few seconds in all.
# ---------------------------------------------------------------------------------------------

FUZZ_EXAMPLES = 200
SMALL_PNG = png_data_uri(8, 8)
ROUTE_SEEDS = {
    "/infer": [{"items": [{"id": "a", "messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Detect."}]}], "images": [SMALL_PNG]}, {"prompt_token_ids": [5, 6]}],
        "sampling": {"max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": ["}"],
                     "repetition_penalty": 1.05, "logprobs": True}, "min_ver": 0, "client": "fuzz"}],
    "/v1/completions": [{"model": "m", "prompt": "Detect.", "max_tokens": 2, "temperature": 0.5, "top_p": 0.9,
                         "top_k": 3, "seed": 1, "stop": ["x"], "repetition_penalty": 1.1, "n": 1, "stream": False},
                        {"prompt": [[1, 2, 3], [4, 5]], "max_completion_tokens": 2}],
    "/v1/chat/completions": [{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": SMALL_PNG}}, {"type": "text", "text": "Detect."}]},
        {"role": "assistant", "content": "{}"}]}],
    "/sync/init": [{"client": "fuzz", "transport": "http", "bucket_bytes": 1 << 20, "timeout_s": 30.0}],
    "/sync/begin": [{"session": "<session>", "mode": "abort", "expected_buckets": 1, "timeout_s": 5.0}],
    "/sync/commit": [{"session": "<session>", "n_buckets": 0, "fingerprint": "f", "min_ver": 3}],
    "/sync/abort": [{"session": "<session>", "reason": "fuzz"}],
    "/sync/update": [{"session": "<session>", "index": 0, "names": ["x"], "dtypes": ["uint8"], "shapes": [[4]],
                      "offsets": [[0, 4]]}],
}
BUCKET_SEED = {"session": "<session>", "index": 0, "names": ["x"], "dtypes": ["uint8"], "shapes": [[4]],
               "offsets": [[0, 4]]}
GET_ROUTES = ["/health", "/metrics", "/v1/models", "/sync/digest", "/docs", "/openapi.json"]
INT_EDGES = [-1, 0, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30]
FLOAT_EDGES = [-1.0, -0.0, 5e-324, 1e-30, 1e30, 1e300]
STR_EDGES = ["", "x" * 300, "\x00"]
ANY_EDGES = [None, [], {}]
HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from(["", "data:image/png;base64,", "/etc/passwd", "data:image/png;base64,AAAA"]),
    st.lists(st.integers(-3, 2**32), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _edges(old) -> list:
    """Edge values for a leaf of ``old``'s JSON type, then type confusions."""
    kind = (FLOAT_EDGES if isinstance(old, float) else INT_EDGES if isinstance(old, int)
            else STR_EDGES if isinstance(old, str) else [])
    return kind + ANY_EDGES


def _paths(node, prefix=()):
    yield prefix
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        yield from _paths(child, (*prefix, key))


def _at(body, path):
    for key in path:
        body = body[key]
    return body


def _replaced(body, path, value):
    body = json.loads(json.dumps(body))
    _at(body, path[:-1])[path[-1]] = value
    return body


def _edge_cases() -> list[tuple]:
    """Every leaf of every seed body at each of its edge values, one at a time (explicit examples)."""
    cases = []
    for route, seeds in ROUTE_SEEDS.items():
        for body in seeds:
            for path in list(_paths(body))[1:]:
                cases += [("json", route, _replaced(body, path, v)) for v in _edges(_at(body, path))]
    for path in list(_paths(BUCKET_SEED))[1:]:
        cases += [("bucket", _replaced(BUCKET_SEED, path, v), b"\0" * 4) for v in _edges(_at(BUCKET_SEED, path))]
    return cases


@st.composite
def mutated(draw, body):
    """``body`` with 1 (mostly) to 3 random mutations: a node replaced by an edge or hostile value,
    dropped, or given a sibling."""
    body = json.loads(json.dumps(body))
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        path = draw(st.sampled_from(list(_paths(body))))
        value = draw(st.one_of(st.sampled_from(_edges(_at(body, path))), HOSTILE))
        if not path:
            return value
        parent = _at(body, path[:-1])
        op = draw(st.sampled_from(["replace", "drop", "add"]))
        if op == "replace":
            parent[path[-1]] = value
        elif op == "drop":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=6))] = value
        else:
            parent.append(value)
    return body


def _cases():
    """("json", path, body) | ("raw", path, bytes) | ("bucket", header, blob) | ("GET", path)."""
    posts = [st.tuples(st.just("json"), st.just(path), mutated(seed))
             for path, seeds in ROUTE_SEEDS.items() for seed in seeds]
    bucket = st.tuples(st.just("bucket"), mutated(BUCKET_SEED), st.binary(max_size=64))
    junk = st.tuples(st.just("raw"), st.sampled_from([*ROUTE_SEEDS, "/sync/bucket", "/nope"]),
                     st.one_of(st.binary(max_size=64), st.just(b"[" * 100000), st.just(b'{"items": 1e999}')))
    return st.one_of(*posts, bucket, junk, st.tuples(st.just("GET"), st.sampled_from(GET_ROUTES)))


def _bounded(body):
    """Keep each case short: a valid max_tokens stays a valid one, but at most 4 (length is what the token
    budget and the disconnect test are for), and a min_ver the server could still reach is 0 (waiting for it
    is by design, up to admission_timeout_s); everything else is sent as drawn."""
    from common.weight_sync.messages import MAX_VER_JUMP

    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and 4 < body[key] <= 32768:
                body[key] = 4
        if isinstance(body.get("min_ver"), int) and "items" in body and 0 < body["min_ver"] <= MAX_VER_JUMP:
            body["min_ver"] = 0
        for v in body.values():
            _bounded(v)
    elif isinstance(body, list):
        for v in body:
            _bounded(v)
    return body


def _with_session(body, session: str):
    return json.loads(json.dumps(body).replace('"<session>"', json.dumps(session)))


def _with_edge_examples(test):
    for case in _edge_cases():
        test = example(case=case)(test)
    return test


@pytest.fixture(scope="module")
def admin_http(server):
    with httpx.Client(base_url=server.url, headers=admin(), timeout=httpx.Timeout(30.0, connect=5.0)) as c:
        yield c


@hypothesis_seed(17)
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(case=_cases())
@_with_edge_examples
def test_fuzzed_requests_to_every_route_get_no_5xx_and_no_hang(admin_http, http, case):
    kind, where, *rest = case
    c, session = admin_http, None  # one keep-alive client for every example (httpx reconnects after a close)
    if kind in ("json", "bucket") and "<session>" in json.dumps(rest[0] if kind == "json" else where):
        opened = c.post("/sync/init", json=ROUTE_SEEDS["/sync/init"][0])  # a live session to aim at
        assert opened.status_code == 200, opened.text
        session = opened.json()["session"]
    try:
        if kind == "GET":
            r = c.get(where)
        elif kind == "raw":
            r = c.post(where, content=rest[0])
        elif kind == "bucket":
            r = c.post("/sync/bucket", content=rest[0],
                       headers={BUCKET_HEADER: json.dumps(_with_session(where, session or "s-none"))})
        else:
            r = c.post(where, json=_bounded(_with_session(rest[0], session or "s-none")))
            if where == "/sync/init" and r.status_code == 200:
                session = r.json()["session"]
        assert r.status_code < 500, (case, r.status_code, r.text[:500])
    finally:
        if session is not None:  # leave the server as found: no session, fence open
            c.post("/sync/abort", json={"session": session})
