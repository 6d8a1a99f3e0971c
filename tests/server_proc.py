"""A real rollout server process for tests: started by PID, stopped by PID, with deadlines.

    with rollout_server_process(tiny_model_dir, ["rollout_server.auth_token=t"]) as srv:
        httpx.get(srv.url + "/health")

The server runs ``python -m rollout_server --config configs/demo_cpu.yaml`` on a fresh loopback
port; its output goes to a log file whose tail is quoted when something times out. :func:`launch`
starts any HTTP server command the same way (benchmarks start ``vllm serve`` with it); with
``new_session`` it leads its own process group, and ``stop`` also ends the children it leaves behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.ports import free_port_block

REPO = Path(__file__).resolve().parents[1]
START_DEADLINE_S = 60.0
STOP_DEADLINE_S = 20.0


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    port: int
    log_path: Path
    statuses_seen: list[str] = field(default_factory=list)  # /health status values while starting
    name: str = "rollout server"
    command: str = "python -m rollout_server"  # named in timeout messages
    own_group: bool = False  # started with its own process group (launch(new_session=True))

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def stop(self, sig: int = signal.SIGTERM, deadline_s: float = STOP_DEADLINE_S) -> int:
        """Signal our own PID, wait up to ``deadline_s``, then SIGKILL; returns the exit code. With its own
        process group, whatever of the group outlives the server (worker processes) is killed too."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGCONT)  # a test may have frozen it (SIGSTOP); a frozen process ignores SIGTERM
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(timeout=deadline_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=deadline_s)
                    raise AssertionError(f"{self.name} pid {self.proc.pid} ignored {signal.Signals(sig).name} for "
                                         f"{deadline_s}s:\n" + self.log_tail()) from None
            return self.proc.returncode
        finally:
            if self.own_group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # our group only: pgid = the leader's pid
                end = time.monotonic() + deadline_s  # gone, not just signalled: the next server needs the GPU
                while _live_members(self.proc.pid) and time.monotonic() < end:
                    time.sleep(0.1)


def _live_members(pgid: int) -> list[int]:
    """PIDs of process group ``pgid`` that are not zombies (from /proc; [] where there is no /proc)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def server_command(model_dir: Path, port: int, overrides: Sequence[str] = (), *,
                   config: Path = REPO / "configs" / "demo_cpu.yaml", log_level: str | None = "warning") -> list[str]:
    """``python -m rollout_server`` on ``port`` serving ``model_dir`` (``log_level`` None: the config's own)."""
    level = [f"rollout_server.log_level={log_level}"] if log_level else []
    return [sys.executable, "-m", "rollout_server", "--config", str(config), f"rollout_server.port={port}",
            f"model.path={model_dir}", *level, *overrides]


def launch(cmd: Sequence[str], port: int, *, env: dict[str, str] | None = None, name: str = "rollout server",
           new_session: bool = False) -> ServerProcess:
    """Start ``cmd`` (an HTTP server on loopback ``port``) from the repo root, output to a log file; return at
    once. ``new_session``: the server leads its own process group (``stop`` then ends its children too)."""
    log_file = tempfile.NamedTemporaryFile(prefix=f"{name.replace(' ', '-')}-{port}-", suffix=".log", delete=False)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # keep a staged site dir
    proc = subprocess.Popen(list(cmd), cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": path, **(env or {})}, start_new_session=new_session)
    log_file.close()
    shown = " ".join(cmd[1:] if cmd[0] == sys.executable else cmd)
    return ServerProcess(proc=proc, url=f"http://127.0.0.1:{port}", port=port, log_path=Path(log_file.name),
                         name=name, command=("python " if cmd[0] == sys.executable else "") + shown,
                         own_group=new_session)


def start_server(model_dir: Path, overrides: Sequence[str] = (), *, env: dict[str, str] | None = None,
                 port: int | None = None, new_session: bool = False, **command: object) -> ServerProcess:
    """Launch a rollout server on ``port`` (None: a fresh one) and return at once (call ``wait_healthy``).

    ``env``: extra environment (e.g. ``CUDA_VISIBLE_DEVICES``); ``command``: :func:`server_command`'s keywords.
    """
    port = port or free_port_block(1)
    return launch(server_command(model_dir, port, overrides, **command), port,
                  env={"TRANSFORMERS_VERBOSITY": "error", **(env or {})}, new_session=new_session)


def wait_healthy(srv: ServerProcess, deadline_s: float = START_DEADLINE_S) -> None:
    """Poll /health until 200; records the statuses seen on the way; AssertionError with the log tail."""
    end = time.monotonic() + deadline_s
    while True:
        if srv.proc.poll() is not None:
            raise AssertionError(f"{srv.name} exited with code {srv.proc.returncode} during start:\n"
                                 + srv.log_tail())
        try:
            r = httpx.get(srv.url + "/health", timeout=2.0)
            try:
                status = r.json().get("status")
            except (ValueError, AttributeError):  # not a JSON object: vllm serve answers an empty 200
                status = str(r.status_code)
            if not srv.statuses_seen or srv.statuses_seen[-1] != status:
                srv.statuses_seen.append(status)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            raise AssertionError(f"{srv.name} on port {srv.port} not healthy after {deadline_s}s "
                                 f"({srv.command}, pid {srv.proc.pid}):\n" + srv.log_tail())
        time.sleep(0.1)


@contextlib.contextmanager
def rollout_server_process(model_dir: Path, overrides: Sequence[str] = (), *, deadline_s: float = START_DEADLINE_S,
                           while_loading=None, stop_signal: int = signal.SIGTERM, print_log_tail: int = 0,
                           **start: object) -> Iterator[ServerProcess]:
    """Start a server, run ``while_loading()`` if given, wait until /health is 200, yield it, stop it.

    ``start``: :func:`start_server`'s keywords (``env``, ``config``, ``log_level``); ``print_log_tail``: lines
    of the server's log printed at the end (GPU tests keep vLLM's log in the pytest output).
    """
    srv = start_server(model_dir, overrides, **start)
    try:
        if while_loading is not None:
            while_loading()
        wait_healthy(srv, deadline_s)
        yield srv
    finally:
        if print_log_tail:
            print(f"---- rollout server log tail ----\n{srv.log_tail(print_log_tail)}")
        srv.stop(stop_signal)
        with contextlib.suppress(OSError):
            os.unlink(srv.log_path)
