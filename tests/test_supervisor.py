"""The launcher's supervisor with tiny stand-in children (``python -c``): actors are restartable parts.

Each stand-in is a few lines of Python that appends to a file when it starts, so a test can see how
often the supervisor started it; the "learner" decides when the run ends by exiting. A stand-in that
is told to stop (SIGTERM) exits 0, as the real processes do. No model, no sockets: seconds per test.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest

from launcher.plan import ProcessSpec
from launcher.supervisor import Supervisor

STOP_ON_SIGTERM = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "


def _spec(name: str, role: str, code: str, tmp: Path, **kw) -> ProcessSpec:
    return ProcessSpec(name=name, role=role, argv=[sys.executable, "-c", STOP_ON_SIGTERM + code], log=tmp / f"{name}.log",
                       **kw)


def _starts(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _learner_until(starts: Path, n: int, then_s: float = 0.3, deadline_s: float = 20.0) -> str:
    """A learner that exits 0 once the actor was started ``n`` times (and ``then_s`` more), 1 at the deadline."""
    return (f"import pathlib; p = pathlib.Path({str(starts)!r}); end = time.time() + {deadline_s}\n"
            f"while time.time() < end and (len(p.read_text().splitlines()) if p.exists() else 0) < {n}: time.sleep(0.05)\n"
            f"time.sleep({then_s}); sys.exit(0 if p.exists() and len(p.read_text().splitlines()) >= {n} else 1)")


def _actor(starts: Path, behaviour: str) -> str:
    """Appends a line to ``starts``, then ``behaviour`` (Python; ``n`` = this start's number, from 1)."""
    return (f"import os, pathlib; p = pathlib.Path({str(starts)!r})\n"
            "with p.open('a') as f: f.write('start\\n')\n"
            f"n = len(p.read_text().splitlines())\n{behaviour}")


def _run(specs: list[ProcessSpec], tmp: Path) -> tuple[int, Supervisor, float]:
    sup = Supervisor(specs, health_timeout_s=10, grace_s=5)
    t0 = time.monotonic()
    code = sup.run()
    sup.write_record(tmp / "processes.json")
    return code, sup, time.monotonic() - t0


def test_a_killed_actor_is_restarted_and_the_run_finishes_with_exit_0(tmp_path, caplog):
    starts = tmp_path / "actor.starts"
    specs = [
        _spec("rollout_server", "server", "time.sleep(60)", tmp_path),
        _spec("learner", "learner", _learner_until(starts, 2), tmp_path),
        # the first process is killed (SIGKILL, as `kill -9` does); the second runs until told to stop
        _spec("actor_r0_0", "actor", _actor(starts, "if n == 1: os.kill(os.getpid(), 9)\ntime.sleep(60)"), tmp_path,
              max_restarts=2, restart_backoff_s=0.1),
    ]
    with caplog.at_level(logging.WARNING, logger="tandem.launcher"):
        code, sup, elapsed = _run(specs, tmp_path)
    assert code == 0, caplog.text
    assert _starts(starts) == 2 and elapsed < 15
    actor = sup.children[2]
    assert (actor.restarts, actor.earlier_exits, actor.returncode) == (1, [-9], 0)
    record = {p["name"]: p for p in json.loads((tmp_path / "processes.json").read_text())["processes"]}
    assert record["actor_r0_0"]["restarts"] == 1 and record["actor_r0_0"]["earlier_exits"] == [-9]
    assert {n: p["returncode"] for n, p in record.items()} == {"rollout_server": 0, "learner": 0, "actor_r0_0": 0}
    assert "actor_r0_0 exited with -9" in caplog.text and "restart 1 of 2" in caplog.text


def test_an_actor_out_of_restarts_stays_down_and_the_run_goes_on_without_it(tmp_path, caplog):
    starts = tmp_path / "actor.starts"
    specs = [
        _spec("rollout_server", "server", "time.sleep(60)", tmp_path),
        _spec("learner", "learner", _learner_until(starts, 3, then_s=0.5), tmp_path),
        _spec("actor_r0_0", "actor", _actor(starts, "sys.exit(3)"), tmp_path, max_restarts=2, restart_backoff_s=0.05),
    ]
    with caplog.at_level(logging.WARNING, logger="tandem.launcher"):
        code, sup, _ = _run(specs, tmp_path)
    assert code == 0, caplog.text
    assert _starts(starts) == 3  # the first start and its 2 restarts; none after the budget
    actor = sup.children[2]
    assert actor.restarts == 2 and actor.earlier_exits == [3, 3] and actor.down
    assert "has used its 2 restarts" in caplog.text and "the run goes on without it" in caplog.text
    record = {p["name"]: p for p in json.loads((tmp_path / "processes.json").read_text())["processes"]}
    assert record["actor_r0_0"]["down"] is True and record["learner"]["returncode"] == 0


def test_an_actor_that_exits_0_has_finished_and_is_not_restarted(tmp_path):
    starts = tmp_path / "actor.starts"
    specs = [
        _spec("rollout_server", "server", "time.sleep(60)", tmp_path),
        _spec("learner", "learner", _learner_until(starts, 1, then_s=0.6), tmp_path),
        _spec("actor_r0_0", "actor", _actor(starts, "sys.exit(0)"), tmp_path, max_restarts=2, restart_backoff_s=0.05),
    ]
    code, sup, _ = _run(specs, tmp_path)
    assert code == 0 and _starts(starts) == 1 and sup.children[2].restarts == 0


def test_a_killed_server_is_restarted_and_the_run_finishes_with_exit_0(tmp_path, caplog):
    starts = tmp_path / "server.starts"
    specs = [
        _spec("rollout_server", "server", _actor(starts, "if n == 1: time.sleep(0.5); os.kill(os.getpid(), 9)\n"
                                                          "time.sleep(60)"), tmp_path, max_restarts=1, restart_backoff_s=0.1),
        _spec("learner", "learner", _learner_until(starts, 2), tmp_path),
    ]
    with caplog.at_level(logging.WARNING, logger="tandem.launcher"):
        code, sup, _ = _run(specs, tmp_path)
    assert code == 0, caplog.text
    assert _starts(starts) == 2 and sup.children[0].earlier_exits == [-9]
    assert "restart 1 of 1" in caplog.text and "launcher.max_server_restarts" in caplog.text


@pytest.mark.parametrize("dies", ["rollout_server", "learner"])
def test_a_server_out_of_restarts_or_a_dead_learner_ends_the_run_and_tears_it_down(tmp_path, caplog, dies):
    starts = tmp_path / "actor.starts"
    server_starts = tmp_path / "server.starts"
    wait_restart = ("import pathlib; p = pathlib.Path(%r)\nwhile not p.exists() or len(p.read_text().splitlines()) < 2: "
                    "time.sleep(0.05)\ntime.sleep(0.3); sys.exit(1)" % str(starts))
    server = _actor(server_starts, "time.sleep(0.5); sys.exit(1)") if dies == "rollout_server" else "time.sleep(60)"
    specs = [
        _spec("rollout_server", "server", server, tmp_path, max_restarts=1, restart_backoff_s=0.1),
        _spec("learner", "learner", wait_restart if dies == "learner" else "time.sleep(60)", tmp_path),
        _spec("actor_r0_0", "actor", _actor(starts, "if n == 1: sys.exit(1)\ntime.sleep(60)"), tmp_path,
              max_restarts=3, restart_backoff_s=0.1),
    ]
    with caplog.at_level(logging.ERROR, logger="tandem.launcher"):
        code, sup, elapsed = _run(specs, tmp_path)
    assert code == 1 and elapsed < 15
    failure = caplog.text.split("run failed")[-1]
    if dies == "rollout_server":
        assert _starts(server_starts) == 2  # one restart, then its death ends the run
        assert "rollout_server exited with 1 and has used its 1 restarts (launcher.max_server_restarts)" in failure
    else:
        assert "learner exited with 1" in failure
        assert sup.children[2].restarts == 1  # the actor had been restarted; the learner's death still ends it
    assert all(c.proc.poll() is not None for c in sup.children)  # torn down, nothing left behind
