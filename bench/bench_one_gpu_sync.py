"""Weight sync where one-GPU users run: the learner beside a vLLM server on the SAME GPU, ``ipc`` vs ``http``.

    python bench/bench_one_gpu_sync.py --model /tmp/tandem-models/0.5b --syncs 5 --out /tmp/one_gpu_sync.json

One vLLM server (``configs/gpu/one_gpu.yaml``'s engine settings, CUDA graphs on) and, in this process,
the learner's copy of the model on the same GPU (bf16). Per transport (``ipc``: CUDA IPC, the server's
worker copies from the learner's buffer; ``http``: packed buckets through the host), one warm-up push,
then ``--syncs`` timed pushes of freshly perturbed weights (every tensor changes). Reported per
transport: the median and max of total (the learner's stall in blocking mode: init + plan +
fingerprint + fence + wire + commit), wire, commit and GB/s over the wire. Correctness: the server's
exact digest (``GET /sync/digest``, over vLLM's own fused parameters, so it is compared with itself)
after the last weights are pushed once more over EVERY transport must be the same each time and
differ from the digest before the last perturbation (exit 2 if not). Final line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

from learner.weight_sync.transport import make_sender  # noqa: E402
from tests.server_proc import rollout_server_process  # noqa: E402


def digest(url: str) -> list[str]:
    r = httpx.get(url + "/sync/digest", timeout=120)
    r.raise_for_status()
    return r.json()["digests"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="/tmp/tandem-models/0.5b")
    ap.add_argument("--transports", default="ipc,http")
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--gpu-mem", type=float, default=0.3)
    ap.add_argument("--eager", action="store_true", help="start the server without CUDA graphs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.bfloat16).to("cuda:0")
    overrides = [f"rollout_server.gpu_memory_utilization={args.gpu_mem}",
                 f"rollout_server.enforce_eager={str(args.eager).lower()}"]
    results: dict[str, dict] = {}
    with rollout_server_process(Path(args.model), overrides, config=REPO / "configs/gpu/one_gpu.yaml", log_level=None,
                                deadline_s=300, print_log_tail=0) as srv:
        for transport in args.transports.split(","):
            rows = []
            with make_sender(srv.url, transport, timeout_s=300) as sender:
                for k in range(args.syncs + 1):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(1e-3 * torch.randn_like(p))
                    rep = sender.push(model.named_parameters(), bucket_bytes=args.bucket_mb << 20)
                    row = {"total_s": rep.total_s, "fence_s": rep.fence_s, "wire_s": rep.wire_s,
                           "commit_s": rep.commit_s, "bytes": rep.bytes, "n_buckets": rep.n_buckets, "warmup": k == 0}
                    rows.append(row)
                    print(transport, json.dumps(row), flush=True)
            timed = [r for r in rows if not r["warmup"]]

            def med(key: str, rows: list[dict] = timed) -> float:
                return statistics.median(r[key] for r in rows)

            results[transport] = {"syncs": len(timed), "total_s_median": med("total_s"),
                                  "total_s_max": max(r["total_s"] for r in timed), "wire_s_median": med("wire_s"),
                                  "commit_s_median": med("commit_s"), "fence_s_median": med("fence_s"),
                                  "wire_gb_s": timed[0]["bytes"] / med("wire_s") / 1e9, "bytes": timed[0]["bytes"],
                                  "n_buckets": timed[0]["n_buckets"]}
        before = digest(srv.url)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn_like(p))
        after = {}
        for transport in args.transports.split(","):
            with make_sender(srv.url, transport, timeout_s=300) as sender:
                sender.push(model.named_parameters(), bucket_bytes=args.bucket_mb << 20)
            after[transport] = digest(srv.url)
        ok = len({tuple(d) for d in after.values()}) == 1 and before not in after.values()
        print(f"digests: before {before}, after the same weights over each transport {after}: "
              f"{'equal, and changed' if ok else 'MISMATCH'}")
    print("| transport | total (median / max) | wire | commit | GB/s (wire) | buckets |\n|---|---|---|---|---|---|")
    for t, r in results.items():
        print(f"| {t} | {r['total_s_median']:.3f} / {r['total_s_max']:.3f} s | {r['wire_s_median']:.3f} s | "
              f"{r['commit_s_median']:.3f} s | {r['wire_gb_s']:.2f} | {r['n_buckets']} |")
    out = {"gpu": torch.cuda.get_device_name(0), "model": args.model, "results": results, "digests_ok": ok}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
