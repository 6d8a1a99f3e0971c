"""A real actor process against a real rollout server, feeding a ZMQ receiver + credit publisher here.

One scenario (module fixture ``run``), several assertions:

    rollout server (python -m rollout_server, hf engine, tiny model)
         ▲ /infer
    actor (python -m actor --rank 0 ...) ── PUSH ──► FakeLearnerRank (PULL + PUB, in this process)
                                       ◄── credits ─┘   consumes one pack every CONSUME_EVERY_S,
                                                        restarts once after RESTART_AFTER packs,
    a second PUSH socket here ── garbage frames ──►     then receives garbage from a second socket

The actor runs with ``actor.dump_pack_digests=true`` so its metrics JSONL lists the sha256 of every
tensor frame it sent; the receiver hashes what it decoded. Deadlines on every wait; the processes
are stopped by their PID.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from common.config.schema import TransportConfig
from tests.fake_learner import FakeLearnerRank
from tests.ports import free_port_block
from tests.server_proc import rollout_server_process

REPO = Path(__file__).resolve().parents[1]
TARGET = 2  # credits: prefetch_target_packs of the fake rank
CONSUME_EVERY_S = 0.3
RESTART_AFTER = 3  # packs received before the receiver restarts
MAX_SAMPLES = 16
ACTOR_DEADLINE_S = 90.0
GARBAGE = [
    [b"not msgpack at all"],
    [msgpack.packb({"schema": 999, "ver": 0})],
    [msgpack.packb([1, 2, 3]), b"\x00" * 8],
    [b"\x81\xa6schema\x01", b"\x01\x02", b"\x03"],
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tiny_model_dir, synth_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("actor-run")
    transport = TransportConfig(host="127.0.0.1", base_port=free_port_block(2), hwm=16)
    learner = FakeLearnerRank(transport, target=TARGET, consume_every_s=CONSUME_EVERY_S, restart_after=RESTART_AFTER,
                              garbage=GARBAGE)
    with learner, rollout_server_process(tiny_model_dir) as server:
        cmd = [sys.executable, "-m", "actor", "--rank", "0", "--config", str(REPO / "configs" / "demo_cpu.yaml"),
               f"model.path={tiny_model_dir}", f"data.train_jsonl={synth_data_dir / 'train.jsonl'}",
               f"training.output_dir={out}", f"transport.base_port={transport.base_port}",
               f"rollout_matching.vllm.servers=[{{base_url: '{server.url}'}}]",
               "rollout_matching.decoding.max_new_tokens=16", f"actor.max_samples={MAX_SAMPLES}",
               "actor.metrics_every_s=1", "actor.dump_pack_digests=true", "training.pack_max_wait_s=0.5",
               "actor.stop_timeout_s=30", "actor.learner_wait_timeout_s=30", "actor.lost_pack_timeout_s=5",
               "stage2_ab.channel_b.rollout_decode_batch_size=2", "training.packing_min_fill_ratio=0.5"]
        log_path = out / "actor.log"
        t0 = time.monotonic()
        with log_path.open("w") as log_f:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_f, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": str(REPO), "TRANSFORMERS_VERBOSITY": "error"})
            try:
                rc = proc.wait(timeout=ACTOR_DEADLINE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
                pytest.fail(f"actor pid {proc.pid} did not finish {MAX_SAMPLES} samples in {ACTOR_DEADLINE_S}s:\n"
                            + log_path.read_text()[-4000:])
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=10)
    elapsed = time.monotonic() - t0
    records = [json.loads(x) for x in (out / "actor_rank0_0.jsonl").read_text().splitlines()]
    return {"rc": rc, "learner": learner, "records": records, "log": log_path.read_text(), "elapsed": elapsed}


def test_the_actor_process_finishes_its_samples_and_exits_cleanly(run):
    assert run["rc"] == 0, run["log"][-3000:]
    assert not run["learner"].errors
    final = [r for r in run["records"] if r["event"] == "final"][-1]
    assert final["actor/samples_taken"] == MAX_SAMPLES and final["actor/errors"] == 0
    assert final["actor/prompt_mismatch"] == 0  # the server templated every prompt exactly like the encoder
    assert final["actor/conservation_ok"] == 1
    assert all(r["actor/conservation_ok"] == 1 for r in run["records"] if r["event"] != "pack")


def test_packs_arrive_intact_bit_identical_to_what_the_actor_sent(run):
    sent = {r["seq"]: r for r in run["records"] if r["event"] == "pack"}
    received = run["learner"].received
    assert len(received) >= RESTART_AFTER + 2
    for got in received:
        assert got.seq in sent, f"received seq {got.seq} the actor never logged"
        assert got.digests == sent[got.seq]["sha256"], f"pack seq {got.seq} changed on the way"
        assert got.keys == sent[got.seq]["keys"]
    keys = [k for got in received for k in got.keys]
    assert len(keys) == len(set(keys)), "a sample arrived twice"


def test_every_pack_is_version_pure(run):
    for got in run["learner"].received:
        assert set(got.segment_vers) == {got.ver}


def test_the_credit_limit_is_respected(run):
    learner = run["learner"]
    assert 1 <= learner.max_unconsumed <= TARGET
    waits = [r for r in run["records"] if r["event"] == "final"][-1]["actor/credit_waits"]
    assert waits > 0  # the limit was actually reached, so the bound was tested


def test_garbage_frames_are_counted_by_the_receiver_and_do_not_stop_it(run):
    learner = run["learner"]
    assert learner.malformed == len(GARBAGE)
    assert learner.garbage_sent_at is not None and len(learner.received) > learner.garbage_sent_at


def test_the_actor_survives_a_receiver_restart(run):
    learner = run["learner"]
    after = [r for r in learner.received if r.incarnation == 1]
    assert learner.incarnation == 1 and len(after) >= 2
    final = [r for r in run["records"] if r["event"] == "final"][-1]
    assert final["actor/learner_restarts"] >= 1


def test_the_whole_scenario_runs_in_under_a_minute(run):
    assert run["elapsed"] < 60, f"actor run took {run['elapsed']:.0f}s"


class _HeldInfer:
    """A real HTTP server on loopback whose ``/infer`` never answers until released: rollouts stay in flight."""

    def __init__(self) -> None:
        import http.server
        import threading

        release = self.release = threading.Event()
        self.calls = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                outer.calls += 1
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                release.wait(120)
                self.send_response(503)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "_HeldInfer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_an_actor_told_done_exits_0_at_once_even_with_rollouts_in_flight(tiny_model_dir, synth_data_dir, tmp_path):
    """The learner's last credits say done while the actor's /infer calls hang: the process must not wait for
    them (its pool threads would hold interpreter exit until the server answered, and the launcher would
    SIGTERM it: exit -15, seen on the two-node run)."""
    transport = TransportConfig(host="127.0.0.1", base_port=free_port_block(2), hwm=16)
    learner = FakeLearnerRank(transport, target=TARGET)
    with learner, _HeldInfer() as server:
        cmd = [sys.executable, "-m", "actor", "--rank", "0", "--config", str(REPO / "configs" / "demo_cpu.yaml"),
               f"model.path={tiny_model_dir}", f"data.train_jsonl={synth_data_dir / 'train.jsonl'}",
               f"training.output_dir={tmp_path}", f"transport.base_port={transport.base_port}",
               f"rollout_matching.vllm.servers=[{{base_url: '{server.url}'}}]",
               "rollout_matching.vllm.infer_timeout_s=120", "actor.learner_wait_timeout_s=30"]
        log_path = tmp_path / "actor.log"
        with log_path.open("w") as log_f:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log_f, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": str(REPO), "TRANSFORMERS_VERBOSITY": "error"})
            try:
                deadline = time.monotonic() + 60
                while server.calls == 0 and time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(0.1)
                assert server.calls > 0, "the actor sent no /infer call:\n" + log_path.read_text()[-3000:]
                learner.done = True
                t0 = time.monotonic()
                try:
                    rc = proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"actor pid {proc.pid} still running 20 s after 'done' with rollouts in flight "
                                "(it waits for its abandoned /infer threads):\n" + log_path.read_text()[-3000:])
                took = time.monotonic() - t0
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
    log = log_path.read_text()
    assert rc == 0, log[-3000:]
    assert "rollout batches in flight abandoned" in log and "exiting: 0 rollout" not in log, log[-3000:]
    assert took < 20  # never the 120 s read deadline of the held calls
