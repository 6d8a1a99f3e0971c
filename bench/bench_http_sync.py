"""HTTP weight sync against a raw loopback socket moving the same bytes, side by side in one run (CPU).

    python bench/bench_http_sync.py [--pushes 5] [--reps 5] [--bucket-mb 64] [--json out.json]
    python bench/bench_http_sync.py --quick      # make test: 2 pushes, 2 socket sends

A real rollout server (hf engine, CPU) serves the ``sync-300mb`` preset of ``tools/make_tiny_model.py``
(~312 MB of float32 weights); this process holds the learner's copy and pushes it with
``HttpWeightSender`` (``learner/weight_sync/http.py``: packed buckets, raw bytes, one reusable host buffer)
through the fence, perturbing every weight before each push. ``http_gb_s`` = bytes / wire time of a
push (packing + transfer + the server staging the tensors; median over the timed pushes, after one
warm-up). ``raw_socket_gb_s``: the same number of bytes through one TCP connection on loopback into a
``recv_into`` loop filling a preallocated buffer in another process (median over ``--reps`` sends) — what
the box's loopback allows. The served weights are checked after the last push (``GET /sync/digest`` == the
exact digest of the pushed tensors; exit 2 if not).
Final line: one JSON object with ``http_gb_s``, ``raw_socket_gb_s`` and their ratio.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

from common.weight_sync import weights as W  # noqa: E402
from learner.weight_sync.base import cast_stream, plan  # noqa: E402
from learner.weight_sync.http import HttpWeightSender  # noqa: E402
from tests.server_proc import rollout_server_process  # noqa: E402
from tools.make_tiny_model import ensure_tiny_model  # noqa: E402

RECEIVER = textwrap.dedent("""
    import socket, sys
    n, reps = int(sys.argv[1]), int(sys.argv[2])
    srv = socket.create_server(("127.0.0.1", 0)); print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept(); buf = memoryview(bytearray(n))
    for _ in range(reps):
        pos = 0
        while pos < n:
            got = conn.recv_into(buf[pos:], min(n - pos, 1 << 20))
            if not got: sys.exit(1)
            pos += got
        conn.sendall(b"k")
""")


def raw_socket_gb_s(data: memoryview, reps: int, deadline_s: float = 120.0) -> list[float]:
    """GB/s of ``reps`` sends of ``data`` to a receiver process on loopback (each acknowledged)."""
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(len(data)), str(reps)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        out = []
        with socket.create_connection(("127.0.0.1", port), timeout=deadline_s) as sock:
            for _ in range(reps):
                t0 = time.perf_counter()
                sock.sendall(data)
                if sock.recv(1) != b"k":
                    raise RuntimeError("the raw-socket receiver closed early")
                out.append(len(data) / (time.perf_counter() - t0) / 1e9)
        proc.wait(timeout=deadline_s)
        return out
    finally:
        if proc.poll() is None:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pushes", type=int, default=5, help="timed pushes (after one warm-up)")
    ap.add_argument("--reps", type=int, default=5, help="raw socket sends")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--model", default="artifacts/sync-300mb", help="built here if missing (sync-300mb preset)")
    ap.add_argument("--quick", action="store_true", help="2 pushes and 2 socket sends (make test)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.pushes, args.reps = 2, 2
    from transformers import AutoModelForImageTextToText

    from learner.weight_sync.served import named_weights

    model_dir = ensure_tiny_model(args.model, preset="sync-300mb")
    weights = dict(named_weights(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)))
    wire, reports = [], []
    with rollout_server_process(Path(model_dir), ["rollout_server.max_bucket_mb=512"]) as srv:
        with HttpWeightSender(srv.url, timeout_s=300, client_id="bench-http-sync") as sender:
            for k in range(args.pushes + 1):
                with torch.no_grad():
                    for t in weights.values():
                        t.add_(1e-3)
                rep = sender.push(weights.items(), bucket_bytes=args.bucket_mb << 20)
                reports.append(rep)
                if k:
                    wire.append(rep.wire_s)
            session = sender.open()
            expected = W.exact_digest(cast_stream(session.info, plan(session.info, weights.items())))
            session.abort("digest check only")
        served = httpx.get(srv.url + "/sync/digest", timeout=120).json()["digests"]
    nbytes = reports[-1].bytes
    raw = raw_socket_gb_s(memoryview(bytearray(nbytes)), args.reps)  # as many bytes as one push
    http = nbytes / statistics.median(wire) / 1e9
    out = {"bench": "http_sync", "bytes": nbytes, "n_buckets": reports[-1].n_buckets, "bucket_mb": args.bucket_mb,
           "pushes": len(wire), "wire_s_median": statistics.median(wire),
           "total_s_median": statistics.median(r.total_s for r in reports[1:]),
           "commit_s_median": statistics.median(r.commit_s for r in reports[1:]),
           "http_gb_s": http, "raw_socket_gb_s": statistics.median(raw), "raw_reps": len(raw),
           "digest_equal": served == [expected]}
    out["ratio"] = out["http_gb_s"] / out["raw_socket_gb_s"]
    print(f"HTTP sync {nbytes / 1e6:.0f} MB in {out['n_buckets']} buckets: wire {out['wire_s_median']:.3f}s "
          f"({http:.2f} GB/s), total {out['total_s_median']:.3f}s; raw socket {out['raw_socket_gb_s']:.2f} GB/s; "
          f"ratio {out['ratio']:.2f}; digest {'equal' if out['digest_equal'] else 'MISMATCH'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0 if out["digest_equal"] else 2


if __name__ == "__main__":
    sys.exit(main())
