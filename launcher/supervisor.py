"""Start the plan's processes, watch them, and tear everything down when one dies.

Data flow of a supervised run::

    start server ──(poll GET /health until 200, deadline rollout_matching.vllm.timeout_s)──►
    start learner (binds the per-rank pack sockets) ──► start actors (wait for credits)
          │
          ▼ every 0.2 s: poll every child
    learner exited 0 ─────────► SIGTERM actors + server, wait `grace_s`, SIGKILL leftovers
    any child exited ≠ 0, or a
    server/actor exited early ─► same teardown, run fails naming the process and its log tail
    SIGINT / SIGTERM to us ────► same teardown, exit 130/143

Each child runs in its own session (process group), so teardown reaches torchrun's workers; we
only ever signal the groups we created.
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
from dataclasses import dataclass, field
from pathlib import Path

from launcher.plan import ProcessSpec

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


def tail(path: Path | None, n: int = 25) -> str:
    if path is None or not path.exists():
        return "(no log)"
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


class Supervisor:
    def __init__(self, specs: list[ProcessSpec], *, health_timeout_s: float, grace_s: float = 20.0,
                 cwd: Path | None = None) -> None:
        self.specs = specs
        self.health_timeout_s = health_timeout_s
        self.grace_s = grace_s
        self.cwd = cwd
        self.children: list[Child] = []
        self._interrupted: int | None = None

    # ---------------------------------------------------------------- lifecycle
    def _start(self, spec: ProcessSpec) -> Child:
        assert spec.log is not None
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(spec.log, "ab", buffering=0)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        proc = subprocess.Popen(spec.argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                start_new_session=True)
        out.close()
        log.info("started %s (pid %d): %s  [log %s]", spec.name, proc.pid, spec.shell(), spec.log)
        child = Child(spec, proc)
        self.children.append(child)
        return child

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
        # Reap stragglers in the groups (torchrun workers) even if the leader already exited.
        for c in self.children:
            try:
                os.killpg(c.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                continue
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for c in self.children:
            c.returncode = c.proc.poll()

    # ---------------------------------------------------------------- run
    def run(self) -> int:
        """Run to completion; returns the launcher's exit code (0 iff every process exited 0)."""
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
                    rc = c.proc.poll()
                    if rc is None or c is learner:
                        continue
                    failure = (f"{c.spec.name} exited with {rc} while the learner was still training; "
                               f"log tail ({c.spec.log}):\n{tail(c.spec.log)}")
                    break
                if failure:
                    break
                rc = learner.proc.poll()
                if rc is not None:
                    if rc != 0:
                        failure = f"learner exited with {rc}; log tail ({learner.spec.log}):\n{tail(learner.spec.log)}"
                    break
                time.sleep(0.2)
        except KeyboardInterrupt:
            failure = f"interrupted by signal {self._interrupted}"
        except LaunchError as exc:
            failure = str(exc)
        finally:
            self.teardown()
            for s, h in old.items():
                signal.signal(s, h)
        codes = {c.spec.name: c.returncode for c in self.children}
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
                           "argv": c.spec.argv, "log": str(c.spec.log)} for c in self.children],
        }, indent=2))
