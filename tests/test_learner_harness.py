"""Test peers and launchers shared by the learner tests (no tests here; imported by test_learner_*).

- :func:`private_copy`: a per-test copy of the tiny model or the dataset.
- :func:`write_config`: a YAML config for the tiny model, synthetic data and fresh loopback ports.
- :class:`Proc`: a child process in its own process group, with a deadline on ``wait`` and a kill
  by that group's id (only processes this test started, never by name).
- :func:`start_server`: the real rollout server (``python -m rollout_server``, hf engine) with its
  log captured, healthy within a deadline.
- :func:`launch_learner`: ``torchrun --standalone --nproc_per_node=W learner/main.py`` (or plain
  ``python learner/main.py`` for W = 1).
- :class:`FakeActor`: a test peer for one learner rank — a real PUSH socket and credits SUB socket,
  sending packs of real encoded segments when its ``policy(credits)`` says so.
- :class:`SyncProxy`: a test peer between learner rank 0 and the rollout server (a slow link): forwards
  every request, records the sync sessions, can hold a push until the learner has trained on.
- readers for ``metrics.jsonl`` and the per-rank ``trace_rank<r>.jsonl`` files (merged here).
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from tests.ports import free_port_block

REPO = Path(__file__).resolve().parents[1]


def private_copy(src: Path, dst: Path) -> Path:
    """A copy of a shared artifact (model, dataset) for one test module, immune to concurrent rebuilds."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".*"))
    return dst


def write_config(path: Path, *, model_dir: Path, data_dir: Path, output_dir: Path, server_port: int | None = None,
                 nproc: int = 2, **sections: Any) -> Path:
    """A complete config; ``sections`` deep-merge over the defaults (e.g. ``training={"max_steps": 4}``)."""
    server_port = server_port or free_port_block(1)
    cfg: dict[str, Any] = {
        "run_name": "test",
        "model": {"path": str(model_dir), "dtype": "float32"},
        "data": {"train_jsonl": str(data_dir / "train.jsonl")},
        "training": {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2, "global_max_length": 768,
                     "lr": 1e-3, "max_steps": 4, "seed": 0, "output_dir": str(output_dir), "progress": False,
                     "trace_micro_steps": True},
        "stage2_ab": {"schedule": {"b_ratio": 0.5},
                      "channel_b": {"mode": "async", "async": {"queue_limit": 4, "version_window": 1,
                                                               "prefetch_target_packs": 3}}},
        "weight_sync": {"transport": "http", "every_steps": 1, "bucket_mb": 1, "timeout_s": 30},
        "rollout_matching": {"vllm": {
            "servers": [{"base_url": f"http://127.0.0.1:{server_port}"}], "timeout_s": 60, "infer_timeout_s": 30},
            "decoding": {"temperature": 0.0, "max_new_tokens": 24}},
        "rollout_server": {"engine": "hf", "port": server_port, "hf_max_batch": 4},
        "transport": {"base_port": free_port_block(2 * nproc), "hwm": 16, "credit_interval_s": 0.1},
        "learner": {"nproc_per_node": nproc, "backend": "gloo", "collective_timeout_s": 90},
    }
    _merge(cfg, sections)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _merge(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


class Proc:
    """A child process started in a new session: ``stop`` signals its whole group by the group id we own."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv, self.log_path = argv, log_path
        self._log = log_path.open("w")
        self.popen = subprocess.Popen(argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)

    def wait(self, timeout_s: float, what: str) -> int:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"{what} did not finish within {timeout_s:.0f}s (killed). Likely cause: a rank stuck in a collective "
                f"or waiting on a peer. Log tail:\n{self.tail()}"
            ) from None

    def stop(self, grace_s: float = 5.0) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)  # the group this Popen created (start_new_session)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=grace_s)
        self._log.close()

    def tail(self, n: int = 60) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def http_json(url: str, timeout_s: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def http_text(url: str, timeout_s: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


def start_server(config: Path, log_path: Path, timeout_s: float = 90.0) -> tuple[Proc, str]:
    """The real rollout server for ``config``; returns once /health says ok (else fails naming the log)."""
    cfg = yaml.safe_load(config.read_text())
    url = cfg["rollout_matching"]["vllm"]["servers"][0]["base_url"]
    proc = Proc([sys.executable, "-m", "rollout_server", "--config", str(config)], log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise AssertionError(f"rollout server exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            if http_json(f"{url}/health").get("status") == "ok":
                return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.stop()
    raise AssertionError(f"rollout server at {url} not healthy within {timeout_s:.0f}s:\n{proc.tail()}")


def launch_learner(config: Path, log_path: Path, nproc: int, overrides: list[str] = ()) -> Proc:
    """The learner as users start it: torchrun for several ranks, plain python for one."""
    if nproc > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "learner/main.py", "--config", str(config), *overrides]
    else:
        argv = [sys.executable, "learner/main.py", "--config", str(config), *overrides]
    return Proc(argv, log_path, env={"OMP_NUM_THREADS": "1"})


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """Rank 0's step records (evaluation records, ``"record": "eval"``, share the file and are left out)."""
    path = output_dir / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r for r in recs if r.get("record", "step") == "step"]


def read_traces(output_dir: Path, world_size: int) -> list[dict[str, Any]]:
    """Every rank's micro-step trace, merged (rank files written by the learner ranks themselves)."""
    out = []
    for r in range(world_size):
        path = output_dir / f"trace_rank{r}.jsonl"
        assert path.exists(), f"rank {r} wrote no trace at {path}: did it start? (see the learner log)"
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


class SegmentPool:
    """Real encoded segments of the synthetic records (tiny model's processor), reused under new ids."""

    def __init__(self, model_dir: Path, data_dir: Path, n: int = 3, packing_length: int = 768) -> None:
        from common.packing.encode import Encoder
        from common.detection.answer import canonical_order
        from common.data.records import load_record
        from common.detection.targets import channel_a_target

        enc = Encoder(model_dir, packing_length, image_root=str(data_dir))
        lines = (data_dir / "train.jsonl").read_text().splitlines()
        self.segments = []
        for i, line in enumerate(lines):
            rec = load_record(json.loads(line))
            tgt = channel_a_target(canonical_order(rec.objects), enc.tokenizer, coord_ids=enc.coord_ids)
            seg = enc.encode(rec, tgt, sample_id=f"pool{i}", channel="B", ver=0)
            if seg is not None:
                self.segments.append(seg)
            if len(self.segments) == n:
                break

    def pack(self, sample_id: str, ver: int):
        from common.packing.segment import Pack

        seg = replace(self.segments[zlib.crc32(sample_id.encode()) % len(self.segments)], sample_id=sample_id, ver=ver, channel="B")
        return Pack(ver=ver, channel="B", segments=[seg])


class FakeActor(threading.Thread):
    """A test peer for learner rank ``rank``: sends the packs ``policy(credits, sent)`` asks for.

    ``policy`` returns a list of vers, one pack each; sample ids are ``<prefix><n>@0`` in order.
    ``first_frames``, if given, is sent once as a raw multipart message when the learner is there.
    Every sent (sample_id, ver) is recorded in ``sent_log``.
    """

    def __init__(self, transport_cfg: Any, rank: int, pool: SegmentPool,
                 policy: Callable[[Any, int], list[int]], prefix: str | None = None,
                 first_frames: list[bytes] | None = None) -> None:
        super().__init__(name=f"fake-actor-r{rank}", daemon=True)
        self.transport_cfg, self.rank, self.pool, self.policy = transport_cfg, rank, pool, policy
        self.prefix = prefix if prefix is not None else f"b{rank}-"
        self.first_frames = first_frames  # a raw message sent once before any pack (e.g. a malformed one)
        self.sent_log: list[tuple[str, int]] = []
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        from common.wire.transport import CreditSubscriber, PackSender, credit_endpoint, pack_endpoint
        from common.wire.codec import pack_to_frames

        sender = PackSender(pack_endpoint(self.transport_cfg, self.rank), hwm=16)
        sub = CreditSubscriber(credit_endpoint(self.transport_cfg, self.rank))
        try:
            if self.first_frames is not None:
                sender.send(self.first_frames, timeout_s=30.0)
            while not self.stop_event.is_set():
                credits = sub.poll(0.05)
                if credits is None:
                    continue
                for ver in self.policy(credits, len(self.sent_log)):
                    sample_id = f"{self.prefix}{len(self.sent_log)}@0"
                    frames = pack_to_frames(self.pool.pack(sample_id, ver), f"fake-r{self.rank}", len(self.sent_log))
                    if not sender.send(frames, timeout_s=2.0):
                        break
                    self.sent_log.append((sample_id, ver))
        except BaseException as exc:  # surfaced by the test
            self.error = exc
        finally:
            sender.close()
            sub.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)


def keep_at_target(credits: Any, sent: int) -> list[int]:
    """Send fresh packs (the rank's ver) until queued + in transit reaches the credits' target."""
    in_transit = max(0, sent - credits.received_total)
    return [credits.ver_current] * max(0, credits.target - credits.depth - in_transit)


@dataclass
class ProxiedSession:
    """One sync session as the proxy saw it (times: time.monotonic(); ``progress``: the learner's at that moment)."""

    client: str
    opened_at: float
    progress_at_begin: int = -1
    ver_before: int | None = None
    closed_at: float | None = None
    outcome: str = "open"  # committed | aborted | failed (an error status on the way)
    ver: int | None = None
    progress_at_commit: int = -1
    held: bool = False  # its first /sync/bucket was seen (and held when the proxy holds)


class SyncProxy(threading.Thread):
    """A slow link in front of a rollout server: every request is forwarded; a test peer, never shipped.

    Binds 127.0.0.1 on a free port (``url``); one thread per connection (keep-alive, as httpx uses it).
    ``hold_first_bucket``: the first ``/sync/bucket`` of each session waits until ``progress()`` (e.g. the
    learner's metrics records) moved past its value at ``/sync/begin``, or ``hold_max_s`` passed — a push
    that only completes once the learner trained on (a blocking learner would sit out the whole hold).
    When the server is gone, requests get a 502 with a JSON ``message`` (the client reports a failed sync).
    Every request's path is counted in ``paths``; sync sessions are recorded in ``sessions``.
    """

    def __init__(self, upstream: str, progress: Callable[[], int] = lambda: 0, *, hold_first_bucket: bool = False,
                 hold_max_s: float = 3.0) -> None:
        super().__init__(name="sync-proxy", daemon=True)
        up = urlsplit(upstream)
        self.upstream = (up.hostname, up.port)
        self.progress, self.hold_first_bucket, self.hold_max_s = progress, hold_first_bucket, hold_max_s
        self.sessions: list[ProxiedSession] = []
        self.paths: dict[str, int] = {}
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                proxy._handle(self)

            def do_POST(self) -> None:
                proxy._handle(self)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def run(self) -> None:
        self.httpd.serve_forever(poll_interval=0.1)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        path = h.path.split("?")[0]
        with self.lock:
            self.paths[path] = self.paths.get(path, 0) + 1
            session = self.sessions[-1] if self.sessions else None
            if path == "/sync/init":
                session = ProxiedSession(client=json.loads(body).get("client", ""), opened_at=time.monotonic())
                self.sessions.append(session)
            first_bucket = path == "/sync/bucket" and session is not None and not session.held
            if first_bucket:
                session.held = True
        if first_bucket and self.hold_first_bucket:
            end = time.monotonic() + self.hold_max_s
            while self.progress() <= session.progress_at_begin and time.monotonic() < end:
                time.sleep(0.02)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "connection", "content-length")}
        try:
            conn = http.client.HTTPConnection(*self.upstream, timeout=120)
            conn.request(h.command, h.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            status, data, ctype = resp.status, resp.read(), resp.getheader("Content-Type", "application/json")
            conn.close()
        except OSError as exc:
            status, ctype = 502, "application/json"
            data = json.dumps({"message": f"rollout server behind the test proxy unreachable: {exc}"}).encode()
        self._record(path, status, data, session)
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _record(self, path: str, status: int, data: bytes, session: ProxiedSession | None) -> None:
        if session is None or not path.startswith("/sync/") or session.closed_at is not None:
            return
        now = time.monotonic()
        if status != 200:
            session.outcome, session.closed_at = "failed", now
        elif path == "/sync/begin":
            session.progress_at_begin, session.ver_before = self.progress(), json.loads(data).get("ver_before")
        elif path == "/sync/commit":
            session.outcome, session.closed_at, session.ver = "committed", now, json.loads(data).get("ver")
            session.progress_at_commit = self.progress()
        elif path == "/sync/abort":
            session.outcome, session.closed_at = "aborted", now
