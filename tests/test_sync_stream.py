"""The HTTP sync's bucket stream (``rollout_server/weight_sync/stream.py`` + ``learner/weight_sync/stream.py``) on a real server.

Buckets travel on a raw connection to the server's own port (opened with ``STREAM_MAGIC``) when the
session offers a ``data_token``; every other connection stays HTTP; through an HTTP-only proxy the
learner falls back to ``POST /sync/bucket`` and says so; a forged token or a stalled bucket is refused
and the session ends with the old weights.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from common.weight_sync.messages import STREAM_MAGIC, SyncBucketHeader
from common.weight_sync import weights as W
from learner.weight_sync.session import SyncError
from learner.weight_sync.base import cast_stream, plan
from learner.weight_sync.http import HttpWeightSender
from tests.server_proc import rollout_server_process
from tests.test_learner_harness import SyncProxy

IDLE_S = 2.0


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    from learner.weight_sync.served import named_weights

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base = {n: t.clone() for n, t in named_weights(model)}
    with rollout_server_process(tiny_model_dir, [f"rollout_server.sync_idle_timeout_s={IDLE_S}"]) as srv:
        yield SimpleNamespace(srv=srv, base=base)


def digest(url: str) -> list[str]:
    r = httpx.get(url + "/sync/digest", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["digests"]


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in base.items()}


def expected_digest(sender: HttpWeightSender, weights: dict[str, torch.Tensor]) -> str:
    session = sender.open()
    try:
        return W.exact_digest(cast_stream(session.info, plan(session.info, weights.items())))
    finally:
        session.abort("digest only")


def test_buckets_go_over_the_stream_and_land_bit_exact_while_http_keeps_serving(served):
    weights = perturbed(served.base, 1)
    with HttpWeightSender(served.srv.url, timeout_s=60) as sender:
        report = sender.push(weights.items(), bucket_bytes=256 << 10)
        assert sender.control.stream.sock is not None and sender.control.stream.fallbacks == 0
        again = sender.push(weights.items(), bucket_bytes=256 << 10)  # the same connection, a new session
        want = expected_digest(sender, weights)
    assert report.n_buckets > 1 and again.ver == report.ver + 1
    assert digest(served.srv.url) == [want]
    assert httpx.get(served.srv.url + "/health", timeout=10).status_code == 200  # HTTP on the same port


def test_through_an_http_only_proxy_the_learner_falls_back_to_post_bodies(served):
    proxy = SyncProxy(served.srv.url)
    proxy.start()
    try:
        weights = perturbed(served.base, 2)
        with HttpWeightSender(proxy.url, timeout_s=60) as sender:
            sender.push(weights.items(), bucket_bytes=256 << 10)
            stream = sender.control.stream
            assert stream.fallbacks == 1 and stream.disabled and stream.sock is None
            want = expected_digest(sender, weights)
        assert proxy.paths.get("/sync/bucket", 0) > 1  # the buckets went through the proxy as HTTP bodies
        assert digest(served.srv.url) == [want]
    finally:
        proxy.stop()


def _stream(served, session, header: SyncBucketHeader, token: str, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", served.srv.port), timeout=15)
    head = json.dumps({"token": token, "bucket": header.model_dump(mode="json")}).encode()
    sock.sendall(STREAM_MAGIC + struct.pack("<I", len(head)) + head + body)
    return sock


def _reply(sock: socket.socket) -> dict:
    raw = b""
    while len(raw) < 4 or len(raw) < 4 + struct.unpack("<I", raw[:4])[0]:
        chunk = sock.recv(65536)
        assert chunk, f"closed without a reply frame (got {raw!r})"
        raw += chunk
    return json.loads(raw[4:])


def test_a_forged_token_is_refused_and_a_stalled_bucket_ends_the_session_with_the_old_weights(served):
    before = digest(served.srv.url)
    ver = httpx.get(served.srv.url + "/health", timeout=10).json()["ver"]
    with HttpWeightSender(served.srv.url, timeout_s=60) as sender:
        session = sender.open()
        session.begin("drain")
        spec = session.info.manifest[0]
        n = torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype)).numel() * (4 if spec.dtype == "float32" else 2)
        header = SyncBucketHeader(session=session.id, index=0, names=[spec.name], dtypes=[spec.dtype],
                                  shapes=[spec.shape], offsets=[(0, n)])
        with _stream(served, session, header, "forged", b"") as sock:
            reply = _reply(sock)
        assert reply["status"] == 401 and "data token" in reply["body"]["message"]
        assert httpx.get(served.srv.url + "/health", timeout=10).json()["sync_state"] == "fenced"  # not ended
        t0 = time.monotonic()
        with _stream(served, session, header, session.info.data_token, b"\0" * (n // 2)) as sock:
            reply = _reply(sock)  # half the bytes, then silence
        assert reply["status"] == 408 and "old weights kept" in reply["body"]["message"], reply
        assert IDLE_S <= time.monotonic() - t0 < IDLE_S + 10
        with pytest.raises(SyncError, match="409"):
            session.commit()
    health = httpx.get(served.srv.url + "/health", timeout=10).json()
    assert (health["ver"], health["sync_state"], health["status"]) == (ver, "idle", "ok")
    assert digest(served.srv.url) == before
