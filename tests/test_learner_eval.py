"""Evaluation during training: PeriodicEval against a real rollout server, HttpInfer's min_ver, and a real learner run.

    PeriodicEval (this process) ── HttpInfer(min_ver) ──► rollout server (python -m rollout_server, tiny model)
    PeriodicEval ─────────────────────────────────────► RecordingServer (a test peer here: records bodies)
    learner/main.py (step mode, 1 process) ── pushes + eval ──► rollout server     (the end-to-end test)

The unit tests' ``write`` is a :class:`Sink` that can hold the evaluation thread inside ``write`` (an
Event, not a sleep), so "an evaluation is running" is a state the test controls.
"""

from __future__ import annotations

import http.server
import json
import re
import threading
import time
from typing import Any

import httpx
import pytest

from common.config.load import load_config
from common.evaluation.loop import HttpInfer, InferError, greedy_sampling, rollout_item
from common.wire.http import InferRequest, InferResponse
from learner.evaluation import PeriodicEval
from tests.ports import free_port_block
from tests.server_proc import rollout_server_process
from tests.test_learner_harness import launch_learner, private_copy, read_metrics, start_server, write_config

WAIT_S = 120.0  # deadline of every wait on an evaluation of a few images by the tiny model on a shared CPU
MAX_IMAGES = 3


class Sink:
    """The ``write`` of PeriodicEval: records every record; while ``hold`` is clear, the writing thread waits."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.arrived = threading.Event()
        self.hold = threading.Event()
        self.hold.set()

    def __call__(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.arrived.set()
        assert self.hold.wait(WAIT_S), "the test never released the evaluation thread"


def eval_cfg(tmp_path, model_dir, data_dir, url: str, **sections: Any):
    port = int(url.rsplit(":", 1)[1])
    base = {"data": {"val_jsonl": str(data_dir / "val.jsonl")},
            "training": {"eval_every_steps": 2, "eval_max_images": MAX_IMAGES},
            "rollout_matching": {"decoding": {"max_new_tokens": 16}, "vllm": {"infer_timeout_s": WAIT_S,
                                                                            "connect_timeout_s": 2}}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    path = write_config(tmp_path / "cfg.yaml", model_dir=model_dir, data_dir=data_dir, output_dir=tmp_path / "run",
                        server_port=port, nproc=1, **base)
    return load_config(path, world_size=1)


def server_ver(url: str) -> int:
    return int(httpx.get(url + "/health", timeout=5.0).json()["ver"])


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with rollout_server_process(tiny_model_dir, ["rollout_server.admission_timeout_s=60"]) as srv:
        yield srv


def push_weights(url: str, model_dir) -> int:
    """Push the model's own weights (ver += 1); returns the new ver."""
    from transformers import AutoModelForImageTextToText

    from learner.weight_sync.served import named_weights
    from learner.weight_sync.http import HttpWeightSender

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    client = HttpWeightSender(url, timeout_s=60)
    try:
        return client.push(named_weights(model), bucket_bytes=1 << 20).ver
    finally:
        client.close()


class RecordingServer(threading.Thread):
    """A test peer that answers /infer with empty outputs at ``ver`` and records each request body."""

    def __init__(self, ver: int = 7) -> None:
        super().__init__(name="recording-server", daemon=True)
        self.bodies: list[dict[str, Any]] = []
        peer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                peer.bodies.append(body)
                out = InferResponse(ver=ver, engine="fake", elapsed_s=0.0, outputs=[
                    {"id": it.get("id"), "token_ids": [], "text": "", "finish_reason": "stop", "prompt_token_ids": [1]}
                    for it in body["items"]]).model_dump_json().encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def run(self) -> None:
        self.httpd.serve_forever(poll_interval=0.1)

    def __enter__(self) -> RecordingServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.join(timeout=5)


# -- PeriodicEval against the real server -------------------------------------------------------------


@pytest.mark.slow
def test_an_evaluation_at_step_0_writes_one_eval_record_of_the_servers_ver(tmp_path, tiny_model_dir, synth_data_dir,
                                                                          server):
    ver = server_ver(server.url)
    sink = Sink()
    pe = PeriodicEval(eval_cfg(tmp_path, tiny_model_dir, synth_data_dir, server.url), is_main=True, write=sink)
    pe.maybe_start(0, ver)
    assert sink.arrived.wait(WAIT_S), "no eval record within the deadline"
    pe._thread.join(WAIT_S)
    (rec,) = sink.records
    assert rec["record"] == "eval" and rec["step"] == 0
    assert rec["eval/n_images"] == MAX_IMAGES
    assert rec["eval/ver"] >= ver and rec["eval/ver_requested"] == ver
    assert 0.0 <= rec["eval/parse_failure_rate"] <= 1.0 and rec["eval/time_s"] > 0
    assert (rec["eval/runs"], rec["eval/skipped_busy"], rec["eval/failures"]) == (1, 0, 0)


@pytest.mark.slow
def test_a_due_evaluation_while_one_runs_is_skipped_and_counted_and_final_waits_then_writes(
        tmp_path, tiny_model_dir, synth_data_dir, server):
    ver = server_ver(server.url)
    sink = Sink()
    pe = PeriodicEval(eval_cfg(tmp_path, tiny_model_dir, synth_data_dir, server.url), is_main=True, write=sink)
    sink.hold.clear()  # the first evaluation stays inside write() until released: it is running
    pe.maybe_start(0, ver)
    assert sink.arrived.wait(WAIT_S)
    assert pe.busy
    pe.maybe_start(2, ver)
    assert pe.counts["eval/skipped_busy"] == 1 and len(sink.records) == 1
    sink.hold.set()
    pe.final(4, ver, deadline_s=WAIT_S)  # joins the running one, then evaluates synchronously
    assert not pe.busy
    assert [r["step"] for r in sink.records] == [0, 4]
    assert sink.records[1]["eval/skipped_busy"] == 1 and sink.records[1]["eval/runs"] == 2


def test_a_non_main_rank_or_a_run_without_val_jsonl_evaluates_nothing(tmp_path, tiny_model_dir, synth_data_dir):
    url = f"http://127.0.0.1:{free_port_block(1)}"  # nothing listens: any request would fail and count
    for cfg, is_main in [(eval_cfg(tmp_path, tiny_model_dir, synth_data_dir, url), False),
                         (eval_cfg(tmp_path, tiny_model_dir, synth_data_dir, url, data={"val_jsonl": None}), True)]:
        sink = Sink()
        pe = PeriodicEval(cfg, is_main=is_main, write=sink)
        pe.maybe_start(0, 1)
        pe.maybe_start(2, 1)
        pe.final(4, 1, deadline_s=5)
        assert not pe.enabled and pe._thread is None and not sink.records
        assert pe.counts == {"eval/runs": 0, "eval/skipped_busy": 0, "eval/failures": 0}


def test_a_server_that_is_down_counts_a_failure_and_does_not_raise(tmp_path, tiny_model_dir, synth_data_dir, caplog):
    url = f"http://127.0.0.1:{free_port_block(1)}"
    sink = Sink()
    pe = PeriodicEval(eval_cfg(tmp_path, tiny_model_dir, synth_data_dir, url), is_main=True, write=sink)
    pe.final(4, 3, deadline_s=5)  # the synchronous path: an exception here would fail the test
    pe.maybe_start(0, 3)
    pe._thread.join(WAIT_S)
    assert pe.counts["eval/failures"] == 2 and pe.counts["eval/runs"] == 0 and not sink.records
    assert "evaluation at step 4 (ver 3) failed" in caplog.text and url in caplog.text


def test_periodic_eval_asks_for_its_ver_as_min_ver_with_the_runs_prompts(tmp_path, tiny_model_dir, synth_data_dir):
    prompts = {"system_prompt": "You detect shapes.", "user_prompt": "List them."}
    with RecordingServer(ver=9) as peer:
        sink = Sink()
        cfg = eval_cfg(tmp_path, tiny_model_dir, synth_data_dir, peer.url, data=prompts)
        pe = PeriodicEval(cfg, is_main=True, write=sink)
        pe.final(6, 8, deadline_s=5)
    (body,) = peer.bodies
    assert body["min_ver"] == 8 and body["client"] == "learner-eval"
    assert len(body["items"]) == MAX_IMAGES, "every image in one request: one ver scores them all"
    texts = [[p["text"] for m in it["messages"] for p in m["content"] if p["type"] == "text"] for it in body["items"]]
    assert texts == [["You detect shapes.", "List them."]] * MAX_IMAGES
    (rec,) = sink.records
    assert (rec["step"], rec["eval/ver"], rec["eval/ver_requested"]) == (6, 9, 8)
    assert rec["eval/parse_failure_rate"] == 1.0  # empty answers


def test_an_evaluation_scored_on_newer_weights_than_it_asked_for_says_so(tmp_path, tiny_model_dir, synth_data_dir,
                                                                        caplog):
    """An abort fence may re-run the request on the next ver (once): the record keeps both vers, the log says why."""
    for served, warned in [(8, False), (9, True)]:
        caplog.clear()
        with RecordingServer(ver=served) as peer:
            pe = PeriodicEval(eval_cfg(tmp_path, tiny_model_dir, synth_data_dir, peer.url), is_main=True, write=Sink())
            pe.final(6, 8, deadline_s=5)
        assert ("scored ver 9, not the ver 8 it asked for" in caplog.text) is warned, caplog.text


class FakeSync:
    """WeightSync's ``boundary`` with a scripted outcome per step: "ok", "fail", "pending" (overlap, in flight) or None."""

    def __init__(self, script: dict[int, str]) -> None:
        self.script = script

    def boundary(self, model: Any, step: int, ver: int):
        from learner.weight_sync.boundary import SyncResult

        outcome = self.script.get(step)
        if outcome is None:
            return None
        return SyncResult(ok=outcome == "ok", ver=ver + (outcome == "ok"), finished=outcome != "pending")


class StartRecorder:
    def __init__(self) -> None:
        self.started: list[tuple[int, int]] = []

    def maybe_start(self, step: int, ver: int) -> None:
        self.started.append((step, ver))


def test_the_learner_starts_an_evaluation_at_the_first_committed_push_from_each_due_step(tmp_path, tiny_model_dir,
                                                                                        synth_data_dir):
    """Learner.maybe_sync's wiring, in-process: due at 0 and every 2 steps; evaluated once the push committed."""
    from types import SimpleNamespace

    import torch

    from learner.rank import Learner
    from learner.step_record import StepRecord

    cfg = eval_cfg(tmp_path, tiny_model_dir, synth_data_dir, "http://127.0.0.1:1")
    learner = Learner(cfg, SimpleNamespace(rank=0, world_size=1, is_main=True, device=torch.device("cpu")))
    learner.model, learner._eval_due = None, True  # as setup() leaves them
    learner.sync = FakeSync({0: "ok", 1: "ok", 2: "fail", 3: "ok", 5: "ok", 6: "pending", 7: "ok", 8: "ok"})
    learner.evals = recorder = StartRecorder()
    for step in range(9):
        learner.step = step
        learner.maybe_sync(StepRecord())
    # 0: start-up push. 2: due, push failed -> 3. 4: due, no push -> 5. 6: due, in flight -> 7. 8: due, pushed.
    assert recorder.started == [(0, 1), (3, 3), (5, 4), (7, 5), (8, 6)]


# -- HttpInfer(min_ver) ---------------------------------------------------------------------------------


def test_http_infer_sends_min_ver_only_when_given(synth_data_dir):
    from common.data.records import iter_jsonl

    rec = next(iter(iter_jsonl(synth_data_dir / "val.jsonl")))
    item = rollout_item(rec, [str(p) for p in rec.image_paths(synth_data_dir)], item_id="x")
    with RecordingServer(ver=4) as peer:
        for min_ver in (3, None):
            client = HttpInfer(peer.url, timeout_s=10, min_ver=min_ver)
            try:
                vers, outs = client([item], greedy_sampling(4))
            finally:
                client.close()
            assert vers == [4] and [o.id for o in outs] == ["x"]
    with_ver, without = (InferRequest.model_validate(b) for b in peer.bodies)
    assert with_ver.min_ver == 3 and without.min_ver is None
    assert "min_ver" not in peer.bodies[1]


@pytest.mark.slow
def test_an_infer_with_min_ver_above_the_servers_ver_waits_for_the_push_that_reaches_it(server, tiny_model_dir,
                                                                                       synth_data_dir):
    from common.data.records import iter_jsonl

    before = server_ver(server.url)
    rec = next(iter(iter_jsonl(synth_data_dir / "val.jsonl")))
    item = rollout_item(rec, [str(p) for p in rec.image_paths(synth_data_dir)], item_id="x")
    client = HttpInfer(server.url, timeout_s=WAIT_S, min_ver=before + 1)
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(result=client([item], greedy_sampling(4))), daemon=True)
    t.start()
    try:
        end = time.monotonic() + WAIT_S
        while not re.search(r"^rollout_admission_waiting 1(\.0)?$", httpx.get(server.url + "/metrics").text, re.M):
            assert t.is_alive(), f"the request returned without waiting for ver {before + 1}: {got}"
            assert time.monotonic() < end, "the /infer with min_ver never showed up as waiting at the server"
            time.sleep(0.05)  # polling the server's gauge, not synchronising on time
        assert push_weights(server.url, tiny_model_dir) == before + 1
        t.join(WAIT_S)
        assert not t.is_alive()
        vers, outs = got["result"]
        assert vers == [before + 1] and outs[0].finish_reason in ("stop", "length")
    finally:
        client.close()


@pytest.mark.slow
def test_an_infer_whose_min_ver_is_never_reached_fails_naming_the_wait(tiny_model_dir, synth_data_dir):
    from common.data.records import iter_jsonl

    rec = next(iter(iter_jsonl(synth_data_dir / "val.jsonl")))
    item = rollout_item(rec, [str(p) for p in rec.image_paths(synth_data_dir)])
    with rollout_server_process(tiny_model_dir, ["rollout_server.admission_timeout_s=1"]) as srv:
        client = HttpInfer(srv.url, timeout_s=30, min_ver=5)
        try:
            with pytest.raises(InferError, match=r"ver >= 5 \(now 0\)"):
                client([item], greedy_sampling(4))
        finally:
            client.close()


# -- a real learner run ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def learner_run(tmp_path_factory, tiny_model_dir, synth_data_dir):
    """learner/main.py in step mode (one process, A steps only) with evaluation, against a real server."""
    tmp = tmp_path_factory.mktemp("learner-eval")
    model, data = private_copy(tiny_model_dir, tmp / "model"), private_copy(synth_data_dir, tmp / "data")
    cfg_path = write_config(
        tmp / "cfg.yaml", model_dir=model, data_dir=data, output_dir=tmp / "run", nproc=1,
        data={"val_jsonl": str(data / "val.jsonl")},
        training={"max_steps": 4, "eval_every_steps": 2, "eval_max_images": MAX_IMAGES},
        stage2_ab={"schedule": {"b_ratio": 0}, "coord_ce_weight": 1.0,
                   "channel_b": {"mode": "step"}},
        weight_sync={"every_steps": 2},
        rollout_matching={"decoding": {"max_new_tokens": 16}},
    )
    server, url = start_server(cfg_path, tmp / "server.log")
    learner = launch_learner(cfg_path, tmp / "learner.log", nproc=1)
    try:
        rc = learner.wait(360, "the step-mode learner with evaluation")
        final_server_ver = server_ver(url)
    finally:
        learner.stop()
        server.stop()
    assert rc == 0, f"learner exited with {rc}:\n{learner.tail()}"
    lines = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    state = json.loads((tmp / "run" / "checkpoints" / "4" / "trainer_state.json").read_text())
    return {"steps": read_metrics(tmp / "run"), "evals": [r for r in lines if r.get("record") == "eval"],
            "state": state, "server_ver": final_server_ver, "log": learner.tail(200)}


@pytest.mark.slow
def test_the_learner_evaluates_at_step_0_every_eval_every_steps_and_after_the_last_step(learner_run):
    evals = learner_run["evals"]
    steps = [r["step"] for r in evals]
    assert steps[0] == 0 and steps[-1] == 4, steps
    assert steps == [0, 2, 4] or (steps == [0, 4] and evals[-1]["eval/skipped_busy"] == 1), steps
    for r in evals:
        assert r["eval/n_images"] == MAX_IMAGES and r["eval/ver"] >= r["eval/ver_requested"] >= 1, r
    assert evals[-1]["eval/runs"] == len(evals) and evals[-1]["eval/failures"] == 0


@pytest.mark.slow
def test_eval_records_leave_the_step_records_as_they_were(learner_run):
    recs = learner_run["steps"]
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    assert [r["global_step"] for r in recs] == [1, 2, 3, 4]
    assert not [k for r in recs for k in r if k.startswith("eval/")]
    assert all(r["loss/coord_ce"] > 0 for r in recs), "coord_ce_weight 1.0 reaches the A steps' loss"


@pytest.mark.slow
def test_the_final_weights_are_pushed_and_the_final_eval_and_checkpoint_share_their_ver(learner_run):
    last, state = learner_run["evals"][-1], learner_run["state"]
    # pushes at boundaries 0 and 2 (weight_sync.every_steps 2), then the final push of step 4's weights
    assert state["ver"] == 3 == learner_run["server_ver"], learner_run["log"]
    assert last["eval/ver"] == last["eval/ver_requested"] == state["ver"]
