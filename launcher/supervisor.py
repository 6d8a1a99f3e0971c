"""Start the plan's processes, watch them, restart dead actors and servers, and tear everything down at the end.

Data flow of a supervised run::

    start server ──(poll GET /health until 200, deadline rollout_matching.vllm.timeout_s)──►
    start learner (binds the per-rank pack sockets) ──► start actors (wait for credits)
          │
          ▼ every 0.2 s: poll every child
    learner exited 0 ─────────► SIGTERM actors + server, wait `grace_s`, SIGKILL leftovers
    learner exited ≠ 0 ───────► same teardown, run fails naming the process and its log tail
    an actor exited ≠ 0 ──────► restart it after its back-off (spec.restart_backoff_s, doubled per restart
                                of that process, ≤ 60 s) while its budget (spec.max_restarts =
                                launcher.max_actor_restarts) lasts; then it stays down (warned) and the
                                run goes on without it: the learner needs no actor (A steps where B
                                packs are short), so the run's exit code stays the learner's
    an actor exited 0 ────────► finished (its learner rank said done, or actor.max_samples): not restarted
    the server exited ────────► restarted the same way (launcher.max_server_restarts); out of restarts,
                                same teardown and the run fails. Meanwhile the learner trains A steps
                                (its syncs fail fast) and actors back off; the restarted server gets the
                                learner's weights at its next due sync, ver moving on from the learner's.
    SIGINT / SIGTERM to us ────► same teardown, exit 130/143

On several learner nodes each node's launcher supervises only what it started (``launcher/plan.py``): node 0 the
server, its torchrun and their actors; node k its torchrun and their actors, nothing to wait for but its own.
A node that dies (machine, launcher or torchrun) fails the collective its peers are in: their learner ranks
exit ≠ 0 within ``learner.collective_timeout_s`` (gloo: at once, the peer's connection closes), so every
other node's learner exits ≠ 0 and its launcher tears down as above, the run failing with that log tail.
Only node 0 prints the run summary and the plot (the metrics are global rank 0's); node k prints its exit codes.

Before a restart the dead leader's process group is SIGKILLed (an engine's workers must not keep
its GPU memory). A restarted actor finds its place by itself (``actor/learner_link.py``, "Rejoin"): what the live learner
already holds from the dead process is skipped, what died with it is produced again.

Each child runs in its own session (process group); we only ever signal the groups we created.
torchrun starts each worker in a session of its own and stops them itself on our SIGTERM: a torchrun
that ignored SIGTERM for ``grace_s`` and is SIGKILLed can leave its workers running (they then fail at
their next collective, or run to their own end).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.plan import ProcessSpec, node_of, record_path

log = logging.getLogger("tandem.launcher")


class LaunchError(RuntimeError):
    """A process failed to start, became unhealthy, or died."""


@dataclass
class Child:
    spec: ProcessSpec
    proc: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    returncode: int | None = None
    stopped_by_us: bool = False
    restarts: int = 0  # processes started again for this spec
    earlier_exits: list[int] = field(default_factory=list)  # exit codes of the processes restarted since
    earlier_pids: list[int] = field(default_factory=list)  # their pids = their process groups (reaped at teardown)
    restart_at: float | None = None  # time.monotonic() of a pending restart (the process is dead meanwhile)
    settled: bool = False  # an actor that exited for good: finished (0) or out of restarts (given up)

    @property
    def down(self) -> bool:
        """Dead on its own at the end: an actor out of restarts, or an actor or server whose restart was pending."""
        restartable = self.spec.role == "actor" or self.restart_at is not None
        return restartable and not self.stopped_by_us and self.proc.returncode not in (0, None)


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left in a process group we created (the group id is its leader's pid)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path | None, n: int = 25) -> str:
    if path is None or not path.exists():
        return "(no log)"
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


class Supervisor:
    def __init__(self, specs: list[ProcessSpec], *, health_timeout_s: float, grace_s: float = 20.0,
                 cwd: Path | None = None, on_tick: Callable[[], Any] | None = None) -> None:
        """``on_tick``: called every loop turn (0.2 s) while the learner runs (the console progress line)."""
        self.specs = specs
        self.on_tick = on_tick
        self.health_timeout_s = health_timeout_s
        self.grace_s = grace_s
        self.cwd = cwd
        self.children: list[Child] = []
        self._interrupted: int | None = None

    # ---------------------------------------------------------------- lifecycle
    def _spawn(self, spec: ProcessSpec) -> subprocess.Popen:
        assert spec.log is not None
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(spec.log, "ab", buffering=0)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        proc = subprocess.Popen(spec.argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                start_new_session=True)
        out.close()
        log.info("started %s (pid %d): %s  [log %s]", spec.name, proc.pid, spec.shell(), spec.log)
        return proc

    def _start(self, spec: ProcessSpec) -> Child:
        child = Child(spec, self._spawn(spec))
        self.children.append(child)
        return child

    def _watch(self, c: Child) -> str | None:
        """One look at an actor or the server: restart it when due; on an exit, settle it, schedule its restart,
        or (the server out of restarts) return the failure that ends the run."""
        now = time.monotonic()
        if c.restart_at is not None:
            if now >= c.restart_at:
                c.restart_at = None
                c.earlier_exits.append(c.proc.returncode)
                c.earlier_pids.append(c.proc.pid)
                _kill_group(c.proc.pid)  # what the dead leader left in its group (e.g. engine workers holding a GPU)
                c.restarts += 1
                c.proc, c.started = self._spawn(c.spec), now
                log.warning("%s restarted (restart %d of %d)", c.spec.name, c.restarts, c.spec.max_restarts)
            return None
        rc = c.proc.poll()
        if rc is None or c.settled:
            return None
        actor, key = c.spec.role == "actor", f"launcher.max_{c.spec.role}_restarts"
        if actor and rc == 0:
            c.settled = True
            log.info("%s finished (exit 0 after %.0f s); not restarted", c.spec.name, now - c.started)
            return None
        if c.restarts >= c.spec.max_restarts:
            spent = f" and has used its {c.spec.max_restarts} restarts ({key})" if c.spec.max_restarts else ""
            if not actor:
                return (f"{c.spec.name} exited with {rc}{spent} while the learner was still training; "
                        f"log tail ({c.spec.log}):\n{tail(c.spec.log)}")
            c.settled = True
            log.warning("%s exited with %d%s: the run goes on without it (the learner trains A steps where its B packs "
                        "are short); log tail (%s):\n%s", c.spec.name, rc, spent, c.spec.log, tail(c.spec.log))
            return None
        delay = min(60.0, c.spec.restart_backoff_s * 2 ** c.restarts)
        c.restart_at = now + delay
        log.warning("%s exited with %d after %.0f s; restart %d of %d in %.1f s (%s, launcher.restart_backoff_s); "
                    "log tail (%s):\n%s", c.spec.name, rc, now - c.started, c.restarts + 1, c.spec.max_restarts, delay,
                    key, c.spec.log, tail(c.spec.log))
        return None

    def _wait_healthy(self, child: Child) -> None:
        url = child.spec.health_url
        deadline = time.monotonic() + self.health_timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            self._check_interrupt()
            if child.proc.poll() is not None:
                raise LaunchError(f"{child.spec.name} exited with {child.proc.returncode} before becoming healthy; "
                                  f"log tail ({child.spec.log}):\n{tail(child.spec.log)}")
            try:
                with urllib.request.urlopen(url, timeout=2.0) as resp:  # noqa: S310 (loopback URL from config)
                    if resp.status == 200:
                        log.info("%s healthy after %.1f s", child.spec.name, time.monotonic() - child.started)
                        return
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.5)
        raise LaunchError(f"waited {self.health_timeout_s:.0f} s for {url} to answer 200 ({last}); "
                          f"raise rollout_matching.vllm.timeout_s or read {child.spec.log}:\n{tail(child.spec.log)}")

    def _check_interrupt(self) -> None:
        if self._interrupted is not None:
            raise KeyboardInterrupt

    def _on_signal(self, signum, _frame) -> None:
        self._interrupted = signum

    def teardown(self) -> None:
        """SIGTERM every live child group, wait up to grace_s, then SIGKILL what is left."""
        live = [c for c in self.children if c.proc.poll() is None]
        for c in live:
            c.stopped_by_us = True
            try:
                os.killpg(c.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.grace_s
        for c in live:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM for %.0f s: SIGKILL", c.spec.name, c.proc.pid, self.grace_s)
                try:
                    os.killpg(c.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                c.proc.wait(timeout=10)
        # Reap stragglers in the groups (e.g. an engine's workers) even if the leader already exited.
        for pgid in [pid for c in self.children for pid in (*c.earlier_pids, c.proc.pid)]:
            _kill_group(pgid)
        for c in self.children:
            c.returncode = c.proc.poll()

    # ---------------------------------------------------------------- run
    def run(self) -> int:
        """Run to completion; the launcher's exit code: 0 iff the learner exited 0 and every process still running
        at the end stopped cleanly (actors down at the end, restarts spent, are warned about, not failed)."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        failure: str | None = None
        try:
            for spec in self.specs:
                child = self._start(spec)
                if spec.health_url:
                    self._wait_healthy(child)
            learner = next(c for c in self.children if c.spec.role == "learner")
            while True:
                self._check_interrupt()
                for c in self.children:
                    if c is not learner and (failure := self._watch(c)):
                        break
                if failure:
                    break
                rc = learner.proc.poll()
                if rc is not None:
                    if rc != 0:
                        failure = f"learner exited with {rc}; log tail ({learner.spec.log}):\n{tail(learner.spec.log)}"
                    break
                if self.on_tick is not None:
                    self.on_tick()
                time.sleep(0.2)
        except KeyboardInterrupt:
            failure = f"interrupted by signal {self._interrupted}"
        except LaunchError as exc:
            failure = str(exc)
        finally:
            self.teardown()
            for s, h in old.items():
                signal.signal(s, h)
        codes = {c.spec.name: c.returncode for c in self.children if not c.down}
        restarted = {c.spec.name: c.restarts for c in self.children if c.restarts}
        if restarted or any(c.down for c in self.children):
            log.warning("restarts: %s; down at the end (the run went on without them): %s", restarted or "none",
                        [c.spec.name for c in self.children if c.down] or "none")
        if failure:
            log.error("run failed: %s", failure)
            return 130 if self._interrupted == signal.SIGINT else (143 if self._interrupted else 1)
        bad = {n: rc for n, rc in codes.items() if rc != 0}
        if bad:
            log.error("processes did not exit cleanly: %s", bad)
            return 1
        return 0

    def exit_codes(self) -> dict[str, int | None]:
        return {c.spec.name: c.returncode for c in self.children}

    def write_record(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "processes": [{"name": c.spec.name, "role": c.spec.role, "pid": c.proc.pid, "returncode": c.returncode,
                           "restarts": c.restarts, "earlier_exits": c.earlier_exits, "down": c.down,
                           "argv": c.spec.argv, "log": str(c.spec.log)} for c in self.children],
        }, indent=2))


def supervise(cfg: Any, specs: list[ProcessSpec], *, grace_s: float) -> int:
    """Run ``specs`` to the end, record them (:func:`launcher.plan.record_path`), then report: the run summary and
    plot on node 0 or the only node, this node's exit codes on node k > 0 (its metrics are node 0's). The exit code
    of :meth:`Supervisor.run`."""
    from launcher.progress import console_progress

    on_tick = None if node_of(cfg) else console_progress(cfg).tick  # node 0 holds the metrics
    sup = Supervisor(specs, health_timeout_s=cfg.rollout_matching.vllm.timeout_s, grace_s=grace_s, on_tick=on_tick)
    t0 = time.monotonic()
    code = sup.run()
    out = Path(cfg.training.output_dir)
    sup.write_record(record_path(cfg))
    if node_of(cfg):
        codes = ", ".join(f"{name}={rc}" for name, rc in sup.exit_codes().items())
        print(f"tandem learner node {node_of(cfg)}: {time.monotonic() - t0:.1f} s, exit codes {codes} "
              f"(the run summary is node 0's; python -m launcher.summary {out})")
        return code
    from launcher.summary import print_summary

    print_summary(out, wall_s=time.monotonic() - t0, exit_codes=sup.exit_codes())
    try:
        from launcher.plot import plot_run

        for png in plot_run(out):
            print(f"plot: {png}")
    except Exception as exc:  # the plot is a convenience; never fail the run for it
        log.warning("plot failed: %s", exc)
    return code
