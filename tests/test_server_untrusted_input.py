"""Trust nothing on the wire, round two (issue 29): a failed /sync request ends its session, text is valid
Unicode, lengths are checked before work, a 5xx keeps the connection, a 405 says what is allowed.

One real rollout server process (the tiny model, a bearer token) for the module; the 5xx case runs the
app in process under a real uvicorn on loopback, with an engine whose generate raises.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from common.wire.http import ErrorResponse
from learner.weight_sync.http import HttpWeightSender
from rollout_server.app import build_app
from tests.ports import free_port_block
from tests.server_proc import rollout_server_process
from tests.stub_engine import StubEngine

pytestmark = pytest.mark.slow

TOKEN = "round-two"
GOOD = {"items": [{"prompt_token_ids": [1, 2, 3]}], "sampling": {"max_tokens": 2, "temperature": 0}}
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with rollout_server_process(tiny_model_dir, [f"rollout_server.auth_token={TOKEN}",
                                                 "rollout_server.admission_timeout_s=60"]) as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(30.0, connect=5.0)) as c:
        yield c
    with httpx.Client(base_url=server.url, timeout=30.0) as c:  # after every test: the fence is open again
        health = c.get("/health").json()
        assert (health["status"], health["sync_state"]) == ("ok", "idle"), health
        assert c.post("/infer", json=GOOD).status_code == 200


def fenced_session(server) -> object:
    """An open session whose fence is closed (begun), as a second sync client would hold it."""
    session = HttpWeightSender(server.url, auth_token=TOKEN, client_id="second-client", timeout_s=60).open()
    session.begin("drain")
    return session


def error_of(r: httpx.Response, status: int) -> ErrorResponse:
    assert r.status_code == status, (r.status_code, r.text)
    return ErrorResponse.model_validate_json(r.content)


# ---------------------------------------------------------------------------------------------
# 1. Any failure of a /sync request inside a session ends it (one rule: SyncController._request_failed)
# ---------------------------------------------------------------------------------------------

MALFORMED_COMMITS = [
    pytest.param({"n_buckets": 0, "min_ver": 2**53}, "min_ver", id="min_ver-above-2^53-1"),
    pytest.param({"n_buckets": "x"}, "n_buckets", id="n_buckets-not-an-int"),
    pytest.param({"n_buckets": 0, "surprise": 1}, "surprise", id="extra-field"),
    pytest.param({"n_buckets": 0, "min_ver": -1}, "min_ver", id="min_ver-negative"),
    pytest.param({"n_buckets": 0, "fingerprint": 5}, "fingerprint", id="fingerprint-not-a-string"),
]


@pytest.mark.parametrize("patch, field", MALFORMED_COMMITS)
def test_a_commit_that_fails_validation_ends_its_session_and_reopens_the_fence(server, http, patch, field):
    ver = http.get("/health").json()["ver"]
    session = fenced_session(server)
    assert http.get("/health").json()["sync_state"] == "fenced"
    err = error_of(http.post("/sync/commit", json={"session": session.id, **patch}, headers=ADMIN), 422)
    assert err.field == field and "sync session aborted, old weights kept" in err.message
    health = http.get("/health").json()
    assert (health["status"], health["sync_state"], health["ver"]) == ("ok", "idle", ver)
    assert session.abort("already ended").aborted is False  # nothing left to abort


@pytest.mark.parametrize("route, body", [
    ("/sync/begin", {"mode": "sideways"}),  # validation, on the open (not yet fenced) session
    ("/sync/abort", {"reason": 7}),
    ("/sync/ipc", {"index": 0, "names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "offsets": [[0, 4]],
                   "source": {"kind": "shm", "size": 4, "path": "tandem-sync-x"}}),  # hf serves no ipc
    ("/sync/commit", {"n_buckets": 3}),  # semantic: nothing was staged
])
def test_every_failed_sync_call_that_names_the_open_session_ends_it(server, http, route, body):
    session = fenced_session(server) if route != "/sync/begin" else \
        HttpWeightSender(server.url, auth_token=TOKEN, timeout_s=60).open()
    r = http.post(route, json={"session": session.id, **body}, headers=ADMIN)
    assert 400 <= r.status_code < 500, r.text
    assert "sync session aborted" in r.json()["message"]
    assert http.get("/health").json()["sync_state"] == "idle"


def test_a_malformed_bucket_header_naming_the_session_ends_it(server, http):
    session = fenced_session(server)
    header = {"session": session.id, "index": 0, "names": ["a"]}  # dtypes, shapes, offsets missing
    r = http.post("/sync/bucket", content=b"\0" * 4, headers={**ADMIN, "X-Tandem-Bucket": json.dumps(header),
                                                                "Content-Type": "application/octet-stream"})
    err = error_of(r, 422)
    assert err.field.startswith("X-Tandem-Bucket") and "sync session aborted" in err.message


def test_a_failed_request_that_names_no_session_leaves_the_holders_session_alone(server, http):
    session = fenced_session(server)
    try:
        err = error_of(http.post("/sync/commit", json={"n_buckets": 0}, headers=ADMIN), 422)
        assert err.field == "session" and "no sync session was ended: this request names none" in err.message
        err = error_of(http.post("/sync/commit", json={"session": "s-guess", "n_buckets": 0}, headers=ADMIN), 409)
        assert err.error == "sync_conflict"  # a stray client cannot end the holder's session
        assert http.get("/health").json()["sync_state"] == "fenced"
    finally:
        assert session.abort("test done").aborted


# ---------------------------------------------------------------------------------------------
# 2. Text is valid Unicode: a lone surrogate is a 422 naming the field, on every route; no 5xx
# ---------------------------------------------------------------------------------------------

SURROGATE = "a \\ud800 b"  # as JSON spells it: a lone high surrogate
SURROGATE_BODIES = [
    pytest.param("/v1/completions", f'{{"model":"m","prompt":"{SURROGATE}","max_tokens":2}}', "prompt", id="completion"),
    pytest.param("/v1/completions", f'{{"model":"m","prompt":["ok","{SURROGATE}"],"max_tokens":2}}', "prompt.1",
                 id="completion-list"),
    pytest.param("/v1/chat/completions",
                 f'{{"model":"m","messages":[{{"role":"user","content":"{SURROGATE}"}}],"max_tokens":2}}',
                 "messages.0.content", id="chat-string"),
    pytest.param("/v1/chat/completions", f'{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text",'
                 f'"text":"{SURROGATE}"}}]}}],"max_tokens":2}}', "messages.0.content.0.text", id="chat-part"),
    pytest.param("/infer", f'{{"items":[{{"messages":[{{"role":"user","content":"{SURROGATE}"}}]}}],'
                 f'"sampling":{{"max_tokens":2}}}}', "items.0.messages.0.content", id="infer-messages"),
    pytest.param("/infer", f'{{"items":[{{"prompt_token_ids":[1,2],"id":"{SURROGATE}"}}],'
                 f'"sampling":{{"max_tokens":2}}}}', "items.0.id", id="infer-id"),
]


def two_requests_on_one_connection(port: int, method: str, path: str, body: bytes) -> list[tuple[int, bytes]]:
    """Send the request, then GET /health on the same keep-alive connection; (status, body) of each."""
    answers = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        f = sock.makefile("rb")
        for m, p, b in ((method, path, body), ("GET", "/health", b"")):
            head = f"{m} {p} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(b)}\r\n\r\n"
            sock.sendall(head.encode() + b)
            status = int(f.readline().split()[1])
            headers = {}
            while (line := f.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            answers.append((status, f.read(int(headers.get("content-length", 0)))))
            if headers.get("connection") == "close":
                break
    return answers


@pytest.mark.parametrize("route, raw, field", SURROGATE_BODIES)
def test_a_lone_surrogate_is_a_422_naming_the_field_and_the_connection_stays_open(server, http, route, raw, field):
    answers = two_requests_on_one_connection(server.port, "POST", route, raw.encode())
    status, body = answers[0]
    assert status == 422, body
    payload = json.loads(body)
    where, message = (payload["error"]["param"], payload["error"]["message"]) if route.startswith("/v1/") else \
        (payload["field"], payload["message"])
    assert where == field and "surrogate" in message
    assert len(answers) == 2 and answers[1][0] in (200, 503), "the connection was closed after the 422"


# ---------------------------------------------------------------------------------------------
# 3. Lengths before work: a prompt longer than the context never takes a ticket or an engine thread
# ---------------------------------------------------------------------------------------------


def test_a_prompt_longer_than_the_context_is_refused_before_admission(server, http):
    """With the fence closed, an admitted request would wait (up to admission_timeout_s = 60 s here): an
    immediate 400 shows the check ran before admission, with nothing encoded."""
    session = fenced_session(server)
    try:
        body = {"items": [{"prompt_token_ids": [7] * 40000}], "sampling": {"max_tokens": 2}}
        r = httpx.post(server.url + "/infer", json=body, timeout=httpx.Timeout(20.0, connect=5.0))
        err = error_of(r, 400)
        assert err.field == "items.0.prompt_token_ids" and "32768 positions" in err.message
        completion = httpx.post(server.url + "/v1/completions", json={"prompt": [7] * 40000, "max_tokens": 2},
                                timeout=httpx.Timeout(20.0, connect=5.0))
        assert completion.status_code == 400 and "positions" in completion.json()["error"]["message"]
    finally:
        session.abort("test done")


def test_a_cancelled_generation_counts_its_tokens(server, http):
    def metric(name: str) -> float:
        line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith(name + " "))
        return float(line.split()[1])

    before = metric("rollout_generated_tokens_total")
    long = {"items": [{"prompt_token_ids": [5, 6, 7]}], "sampling": {"max_tokens": 3000, "temperature": 1.0,
                                                                        "seed": 0, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/infer", json=long, timeout=httpx.Timeout(1.5, connect=5.0))
    deadline = time.monotonic() + 60
    while metric("rollout_generated_tokens_total") == before:
        assert time.monotonic() < deadline, "the cancelled generation's tokens were never counted:\n" + server.log_tail()
        time.sleep(0.1)
    assert 0 < metric("rollout_generated_tokens_total") - before < 3000


# ---------------------------------------------------------------------------------------------
# 4. The schema's promises: 405 says what is allowed; /metrics is text
# ---------------------------------------------------------------------------------------------


def test_a_wrong_method_gets_405_with_an_allow_header(http):
    r = http.request("TRACE", "/infer")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = http.delete("/health")
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_the_openapi_schema_states_the_limits_the_server_enforces(http):
    spec = http.get("/openapi.json").json()
    comps = spec["components"]["schemas"]
    assert {"required": ["messages"]}.items() <= comps["InferItem"]["oneOf"][0].items()
    assert comps["SyncInitRequest"]["then"]["required"] == ["master_addr", "master_port", "world_size"]
    bucket = spec["paths"]["/sync/bucket"]["post"]["parameters"]
    assert any(p["name"] == "X-Tandem-Bucket" and p["required"] for p in bucket)
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "400" in spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert comps["CompletionRequest"]["properties"]["prompt"]["anyOf"][0]["minLength"] == 1


# ---------------------------------------------------------------------------------------------
# A 5xx keeps the keep-alive connection (in process: an engine whose generate raises)
# ---------------------------------------------------------------------------------------------


class _FailingEngine(StubEngine):
    async def generate(self, items, sampling):
        raise RuntimeError("the engine broke")


def test_an_engine_failure_is_a_500_body_and_the_connection_stays_open():
    cfg = SimpleNamespace(sync_idle_timeout_s=30.0, auth_token=None, max_batch_items=4, admission_timeout_s=5.0,
                          max_bucket_mb=16)
    port = free_port_block(1)
    server = uvicorn.Server(uvicorn.Config(build_app(_FailingEngine("m"), cfg, engine_started=True),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start within 30 s"
            time.sleep(0.05)
        answers = two_requests_on_one_connection(port, "POST", "/infer", json.dumps(GOOD).encode())
        assert answers[0][0] == 500
        err = ErrorResponse.model_validate_json(answers[0][1])
        assert err.error == "engine_error" and "the engine broke" in err.message
        assert len(answers) == 2 and answers[1][0] == 200, "the connection was closed after the 500"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
