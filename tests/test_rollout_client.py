"""The actors' rollout client: retry, split, back-off, load spread and readiness, against real peers.

The peers are small FastAPI apps served by uvicorn on loopback ports that fail or stall on purpose
(a scripted fault per request); they speak the real protocol models, so the client is exercised
over real HTTP, connections and timeouts.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from actor.client import RolloutClient, RolloutError, RolloutRequestError, RolloutUnavailable
from common.wire.http import HealthResponse, InferOutput, InferRequest, InferResponse, SamplingParams
from tests.ports import free_port_block

SAMPLING = SamplingParams(max_tokens=4, temperature=0)


@dataclass
class FaultPeer:
    """A loopback /infer peer: ``faults`` are consumed one per request (None = answer normally)."""

    url: str = ""
    faults: list = field(default_factory=list)  # "500" | "503" | "stall" | "drop" | "422" | None
    fail_batches_over: int | None = None  # answer 500 to any batch with more items than this
    ver: int = 0
    bump_ver_each_call: bool = False
    status: str = "ok"
    schema: int | None = None
    delay_s: float = 0.0
    requests: list[int] = field(default_factory=list)  # batch size of every request received
    server: uvicorn.Server | None = None

    def reset(self) -> None:
        self.faults, self.fail_batches_over, self.ver, self.bump_ver_each_call = [], None, 0, False
        self.status, self.schema, self.delay_s, self.requests = "ok", None, 0.0, []

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            body = HealthResponse(status=self.status, engine="fault-peer", model="m", ver=self.ver,
                                  sync_state="idle", world_size=1).model_dump(by_alias=True)
            if self.schema is not None:
                body["schema"] = self.schema
            return JSONResponse(body, status_code=200 if self.status == "ok" else 503)

        @app.post("/infer")
        async def infer(req: InferRequest, request: Request):
            self.requests.append(len(req.items))
            fault = self.faults.pop(0) if self.faults else None
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if fault == "stall":
                await asyncio.sleep(3.0)
            if fault == "drop":  # close the connection without an answer
                raise ConnectionResetError("dropped on purpose")
            if fault in ("500", "503", "422"):
                return JSONResponse({"error": "engine_error", "message": f"injected {fault}"}, status_code=int(fault))
            if self.fail_batches_over is not None and len(req.items) > self.fail_batches_over:
                return JSONResponse({"error": "engine_error", "message": "batch too big (injected)"}, status_code=500)
            ver = self.ver
            if self.bump_ver_each_call:
                self.ver += 1
            outs = [InferOutput(id=it.id, token_ids=[k], text=str(k), finish_reason="length",
                                prompt_token_ids=it.prompt_token_ids or [0]) for k, it in enumerate(req.items)]
            return InferResponse(ver=ver, outputs=outs, engine="fault-peer", elapsed_s=0.0)

        return app


def _serve(peer: FaultPeer) -> FaultPeer:
    port = free_port_block(1)
    peer.url = f"http://127.0.0.1:{port}"
    peer.server = uvicorn.Server(uvicorn.Config(peer.app(), host="127.0.0.1", port=port, log_level="critical"))
    threading.Thread(target=peer.server.run, daemon=True).start()
    end = time.monotonic() + 20
    while not peer.server.started:
        assert time.monotonic() < end, "fault peer did not start within 20s"
        time.sleep(0.02)
    return peer


@pytest.fixture(scope="module")
def peers():
    ps = [_serve(FaultPeer()), _serve(FaultPeer())]
    yield ps
    for p in ps:
        p.server.should_exit = True


@pytest.fixture
def peer(peers):
    for p in peers:
        p.reset()
    return peers[0]


def items(n: int) -> list[dict]:
    return [{"id": f"s{k}", "prompt_token_ids": [k + 1]} for k in range(n)]


def client_for(*urls: str, **kw) -> RolloutClient:
    kw.setdefault("retry_backoff_s", 0.01)
    kw.setdefault("read_timeout_s", 1.0)
    kw.setdefault("connect_timeout_s", 1.0)
    return RolloutClient(list(urls), **kw)


@pytest.mark.parametrize("fault", ["500", "503", "drop", "stall"])
def test_a_failed_or_stalled_call_is_retried_once_on_a_fresh_connection(peer, fault):
    peer.faults = [fault]
    with client_for(peer.url, read_timeout_s=0.5) as c:
        result = c.infer(items(3), SAMPLING)
    assert peer.requests == [3, 3]
    assert [o.id for o in result.outputs] == ["s0", "s1", "s2"] and not result.split
    assert c.counts["retries"] == 1 and c.counts["splits"] == 0


def test_a_batch_that_keeps_failing_is_split_in_halves_recursively_until_it_succeeds(peer):
    peer.fail_batches_over = 2
    with client_for(peer.url) as c:
        result = c.infer(items(8), SAMPLING)
    assert [o.id for o in result.outputs] == [f"s{k}" for k in range(8)]  # order kept across the splits
    assert [len(r.outputs) for r in result.responses] == [2, 2, 2, 2]
    assert peer.requests == [8, 8, 4, 4, 2, 2, 4, 4, 2, 2]
    assert c.counts["splits"] == 3


def test_halves_of_a_split_batch_carry_their_own_ver(peer):
    peer.fail_batches_over, peer.bump_ver_each_call, peer.ver = 2, True, 5
    with client_for(peer.url) as c:
        result = c.infer(items(4), SAMPLING)
    assert result.vers == [5, 5, 6, 6] and result.ver is None and result.split
    from actor.pipeline import rollouts_from_response

    assert [r.ver for r in rollouts_from_response(result)] == [5, 5, 6, 6]


def test_an_item_that_always_fails_raises_naming_it_after_retries_and_splits(peer):
    peer.faults = ["500"] * 20
    with client_for(peer.url) as c, pytest.raises(RolloutError, match="item s0 failed") as info:
        c.infer(items(2), SAMPLING)
    assert "injected 500" in str(info.value) and "1 split(s)" in str(info.value)
    assert peer.requests == [2, 2, 1, 1]  # the first half's failure ends the call: no time spent on the rest


def test_a_4xx_is_not_retried(peer):
    peer.faults = ["422"]
    with client_for(peer.url) as c, pytest.raises(RolloutRequestError, match="injected 422") as info:
        c.infer(items(2), SAMPLING)
    assert info.value.status == 422 and peer.requests == [2]


def test_backoff_is_exponential_with_jitter_per_split_level(peer):
    peer.faults = ["500"] * 6
    slept: list[float] = []
    with client_for(peer.url, retry_backoff_s=1.0, retry_backoff_max_s=3.0, sleep=slept.append,
                    rng=random.Random(0)) as c, pytest.raises(RolloutError):
        c.infer(items(2), SAMPLING)
    # retry at depth 0, back-off before splitting (depth 1), the first half's retry (depth 1)
    bases = [1.0, 2.0, 2.0]
    assert len(slept) == len(bases)
    for s, b in zip(slept, bases):
        assert 0.5 * b <= s <= 1.5 * b


def test_load_spreads_over_two_servers_and_a_retry_goes_to_the_other_one(peers):
    a, b = peers
    for p in peers:
        p.reset()
    with client_for(a.url, b.url, balance="round_robin") as c:
        for _ in range(6):
            c.infer(items(1), SAMPLING)
        assert len(a.requests) == len(b.requests) == 3
        a.faults = ["500"]
        a.requests.clear(), b.requests.clear()
        c.infer(items(1), SAMPLING)  # may start on a or b; a failure on a is retried on b
    assert len(b.requests) >= 1
    for p in peers:
        p.reset()
    a.delay_s = 1.0  # a slow server keeps calls in flight: least_inflight sends the later ones to b
    with client_for(a.url, b.url, balance="least_inflight", read_timeout_s=5.0) as c:
        threads = [threading.Thread(target=c.infer, args=(items(1), SAMPLING)) for _ in range(8)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=30)
    assert len(a.requests) + len(b.requests) == 8 and len(b.requests) > len(a.requests) > 0


def test_refused_connections_raise_unavailable_with_the_command_that_starts_the_server():
    dead = f"http://127.0.0.1:{free_port_block(1)}"
    with client_for(dead, config_path="configs/demo_cpu.yaml") as c, pytest.raises(RolloutUnavailable) as info:
        c.infer(items(4), SAMPLING)
    msg = str(info.value)
    assert dead in msg and "make launch-rollout CONFIG=configs/demo_cpu.yaml" in msg
    assert "python -m rollout_server --config configs/demo_cpu.yaml" in msg
    assert c.counts["splits"] == 0  # splitting cannot help when nobody listens


def test_wait_until_ready_times_out_naming_the_url_and_the_start_command():
    dead = f"http://127.0.0.1:{free_port_block(1)}"
    t0 = time.monotonic()
    with client_for(dead, config_path="configs/demo_cpu.yaml") as c, pytest.raises(TimeoutError) as info:
        c.wait_until_ready(deadline_s=0.6)
    assert time.monotonic() - t0 < 5
    msg = str(info.value)
    assert dead in msg and "not ready after 1s" in msg
    assert "python -m rollout_server --config configs/demo_cpu.yaml" in msg and "make launch-rollout" in msg


def test_wait_until_ready_waits_through_loading_and_accepts_syncing(peers):
    a, b = peers
    for p in peers:
        p.reset()
    a.status, b.status = "loading", "syncing"
    threading.Timer(0.4, lambda: setattr(a, "status", "ok")).start()
    with client_for(a.url, b.url) as c:
        ready = c.wait_until_ready(deadline_s=10)
    assert set(ready) == {a.url, b.url}


def test_wait_until_ready_fails_fast_on_a_schema_mismatch(peer):
    peer.schema = 999
    with client_for(peer.url) as c, pytest.raises(RolloutError, match="schema 999"):
        c.wait_until_ready(deadline_s=10)


def test_a_client_from_config_reads_servers_and_timeouts(tiny_model_dir):
    from common.config.load import load_config

    cfg = load_config("configs/demo_cpu.yaml", ["rollout_matching.vllm.infer_timeout_s=7",
                                                 "rollout_matching.vllm.balance=round_robin"])
    with RolloutClient.from_config(cfg, client_id="actor-r0-0") as c:
        assert c.servers == ["http://127.0.0.1:8310"] and c.timeout.read == 7 and c.balance == "round_robin"
    assert httpx  # the client is httpx-based: no other HTTP stack needed on actors
