"""Tokens/s of tandem's rollout server against ``vllm serve``: same model, same GPU, same settings.

    python bench/bench_vs_vllm_serve.py --rounds 5 --out /tmp/bench_vs_vllm_serve.json
    python bench/bench_vs_vllm_serve.py --model /tmp/tandem-models/0.5b --requests 256 --concurrency 32 \\
        --max-tokens 128 --gpu-mem 0.3 --pairs 2

One server at a time on one GPU (``--gpu``), each started once per pair, health-waited (``--start-timeout``,
vLLM takes 60-90 s) and stopped by PID with its process group before the next one starts:

  1. ``vllm serve <model>`` (``python -m vllm.entrypoints.cli.main serve`` with the vLLM this interpreter
     imports, the one tandem's engine runs; else the ``vllm`` script on PATH);
  2. ``python -m rollout_server --config configs/gpu/split_1p1.yaml rollout_server.enforce_eager=false ...``.

Both get the same ``gpu_memory_utilization``, ``max_model_len``, dtype bfloat16, seed 0 and CUDA graphs
(``enforce_eager`` off); ``vllm serve`` also ``--generation-config vllm`` (tandem's server never applies the
checkpoint's sampling defaults) and ``--disable-uvicorn-access-log`` (tandem logs no access lines);
``--vllm-args`` adds more (e.g. ``--max-num-seqs 128`` to match AsyncLLM's engine defaults, which differ
from ``vllm serve``'s: see the engine lines the bench prints). Both inherit this environment, with
``VLLM_USE_FLASHINFER_SAMPLER=0`` unless it is set.

Per server, after one warm-up round (CUDA graphs, allocator): ``--rounds`` timed rounds of ``--requests``
``/v1/completions`` requests through the official ``openai`` client, ``--concurrency`` in flight, greedy
with ``ignore_eos`` so every request generates ``--max-tokens`` tokens (counted from
``usage.completion_tokens``); on tandem also ``--rounds`` rounds of ``/infer`` (the actors' route: the same
prompts as text-only chat items, ``--infer-batch`` per request). Printed per server and route: tokens/s
(median over rounds), requests/s, items/s, latency p50/p90, the ratio to ``vllm serve``; the last line is
one JSON object. The driver and statistics are bench/serve_compare_lib.py (tests/test_bench_vs_vllm_serve.py
runs them on CPU against tandem's hf engine).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import serve_compare_lib as lib  # noqa: E402

from tests.server_proc import ServerProcess, launch, start_server, wait_healthy  # noqa: E402

DEFAULT_MODEL = "/tmp/tandem-models/0.5b"
STOP_DEADLINE_S = 120.0


def vllm_cli() -> list[str]:
    """The vLLM this interpreter imports (the one tandem's engine runs) as a module, else ``vllm`` on PATH."""
    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    exe = shutil.which("vllm")
    if exe is None:
        raise SystemExit("vLLM is neither importable here (PYTHONPATH) nor a `vllm` script on PATH (docs/gpu.md)")
    return [exe]


def vllm_serve_command(model: str, port: int, gpu_mem: float, max_model_len: int, extra: list[str]) -> list[str]:
    """``vllm serve`` with the settings tandem's server passes to AsyncLLM."""
    return [*vllm_cli(), "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--gpu-memory-utilization", str(gpu_mem), "--max-model-len", str(max_model_len), "--dtype", "bfloat16",
            "--seed", "0", "--generation-config", "vllm", "--disable-uvicorn-access-log", *extra]


def tandem_overrides(gpu_mem: float, max_model_len: int, extra: list[str]) -> list[str]:
    return ["rollout_server.enforce_eager=false", f"rollout_server.gpu_memory_utilization={gpu_mem}",
            f"rollout_server.max_model_len={max_model_len}", *extra]


def ensure_model(path: str | None) -> Path:
    """``--model``, or the 0.5b preset at DEFAULT_MODEL, built with tools/make_tiny_model.py when absent."""
    model = Path(path or DEFAULT_MODEL).resolve()
    if (model / "config.json").is_file():
        return model
    if path is not None:
        raise SystemExit(f"--model {model}: no config.json there")
    cmd = [sys.executable, str(REPO / "tools" / "make_tiny_model.py"), "--preset", "0.5b", "--out", str(model)]
    print(f"building the 0.5b model: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, timeout=1800)
    return model


def start(name: str, args: argparse.Namespace, model: Path) -> ServerProcess:
    env = {"CUDA_VISIBLE_DEVICES": str(args.gpu),
           "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0")}
    if name == "vllm_serve":
        port = args.port_vllm or free_port()
        cmd = vllm_serve_command(str(model), port, args.gpu_mem, args.max_model_len, shlex.split(args.vllm_args))
        srv = launch(cmd, port, env=env, name="vllm serve", new_session=True)
    else:
        srv = start_server(model, tandem_overrides(args.gpu_mem, args.max_model_len, args.tandem_overrides),
                           env=env, port=args.port_tandem or None, new_session=True,
                           config=Path(args.tandem_config).resolve(), log_level=None)
    print(f"[{name}] pid {srv.proc.pid}: {srv.command}  (log {srv.log_path})", flush=True)
    return srv


def free_port() -> int:
    from tests.ports import free_port_block

    return free_port_block(1)


def model_id(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def run_server(name: str, args: argparse.Namespace, model: Path, texts: list[str], rounds: dict) -> dict:
    """Start one server, warm it up, run its timed rounds into ``rounds[label]``, stop it; returns facts."""
    srv = start(name, args, model)
    facts: dict = {"command": srv.command}
    t0 = time.monotonic()
    try:
        wait_healthy(srv, args.start_timeout)
        facts["start_s"] = round(time.monotonic() - t0, 1)
        mid = model_id(srv.url)
        routes = ["completions"] + (["infer"] if name == "tandem" and args.infer_batch > 0 else [])

        def one(route: str, texts_: list[str]) -> lib.RoundResult:
            if route == "completions":
                work = lib.drive_completions(srv.url, mid, texts_, concurrency=args.concurrency,
                                             max_tokens=args.max_tokens, timeout_s=args.request_timeout)
            else:
                work = lib.drive_infer(srv.url, texts_, batch=args.infer_batch, concurrency=args.concurrency,
                                       max_tokens=args.max_tokens, timeout_s=args.request_timeout)
            return asyncio.run(asyncio.wait_for(work, args.round_timeout))

        for route in routes:  # warm-up: CUDA graphs, allocator, connection pools
            one(route, texts[: max(args.concurrency, args.infer_batch)])
        for r in range(args.rounds):
            for route in routes:
                res = one(route, texts)
                label = name if route == "completions" else f"{name} /infer"
                rounds.setdefault(label, []).append(res)
                s = res.summary()
                print(f"[{label}] round {r + 1}: {s['tokens_per_s']:.1f} tok/s, {s['requests_per_s']:.2f} req/s, "
                      f"p50 {s['latency_p50_s']:.3f}s, {res.tokens} tokens{'' if s['full_length'] else ' (SHORT)'}",
                      flush=True)
    finally:
        try:
            facts["exit_code"] = srv.stop(deadline_s=STOP_DEADLINE_S)
        except AssertionError as exc:  # it ignored SIGTERM: its group was killed; the figures stand
            print(f"[{name}] {exc}", flush=True)
        facts["engine_log"] = lib.engine_log_lines(srv.log_path.read_text(errors="replace"))
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            facts["log"] = str(shutil.copy(srv.log_path, Path(args.log_dir) / f"{name}-{srv.port}.log"))
        srv.log_path.unlink(missing_ok=True)
    return facts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help=f"model dir (default: the 0.5b preset at {DEFAULT_MODEL}, "
                                                  "built if absent)")
    ap.add_argument("--requests", type=int, default=256, help="prompts per round (= /v1/completions requests)")
    ap.add_argument("--concurrency", type=int, default=32, help="sequences in flight")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per server and route")
    ap.add_argument("--pairs", type=int, default=1, help="start the servers this many times each, in turn")
    ap.add_argument("--infer-batch", type=int, default=8, help="items per /infer request on tandem (0: skip /infer)")
    ap.add_argument("--gpu-mem", type=float, default=0.3, help="gpu_memory_utilization of both servers")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu", default="0", help="CUDA_VISIBLE_DEVICES of both servers")
    ap.add_argument("--port-vllm", type=int, default=0, help="0: a free port")
    ap.add_argument("--port-tandem", type=int, default=0, help="0: a free port")
    ap.add_argument("--servers", default="vllm_serve,tandem", help="which to run, in this order")
    ap.add_argument("--vllm-args", default="", help='extra vllm serve arguments, one string: '
                                                    '--vllm-args="--max-num-seqs 128"')
    ap.add_argument("--tandem-config", default=str(REPO / "configs" / "gpu" / "split_1p1.yaml"))
    ap.add_argument("--tandem-overrides", nargs="*", default=[], help="extra dotted overrides for tandem's server")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server to answer /health")
    ap.add_argument("--round-timeout", type=float, default=600.0, help="seconds for one round")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds for one request")
    ap.add_argument("--log-dir", default=None, help="copy each server's log here (default: not kept)")
    ap.add_argument("--out", default=None, help="write the full result (rounds, engine log lines) here as JSON")
    args = ap.parse_args(argv)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or set(servers) - {"vllm_serve", "tandem"}:
        ap.error(f"--servers {args.servers!r}: a comma list of vllm_serve, tandem")
    if min(args.requests, args.concurrency, args.max_tokens, args.rounds, args.pairs) < 1:
        ap.error("--requests, --concurrency, --max-tokens, --rounds and --pairs must be >= 1")

    if "vllm_serve" in servers:
        vllm_cli()  # before a model is built: SystemExit naming the fix when there is no vLLM
    model = ensure_model(args.model)
    texts = lib.prompts(args.requests)
    rounds: dict[str, list[lib.RoundResult]] = {}
    facts: dict[str, list[dict]] = {}
    failed = []
    for _ in range(args.pairs):
        for name in servers:
            runs = facts.setdefault(name, [])
            try:
                runs.append(run_server(name, args, model, texts, rounds))
            except Exception as exc:  # noqa: BLE001 - report it and go on with the other server
                print(f"[{name}] FAILED: {type(exc).__name__}: {exc}", flush=True)
                failed.append(name)
                runs.append({"error": f"{type(exc).__name__}: {exc}"[:4000]})

    summaries = {label: lib.summarize(rs) for label, rs in rounds.items()}
    rat = lib.ratios(summaries)
    for name, runs in facts.items():
        ran = [r for r in runs if "engine_log" in r]
        if ran:
            print(f"---- {name} engine ({ran[0]['command']})")
            print("\n".join(f"  {line}" for line in ran[0]["engine_log"]) or "  (no engine lines in its log)")
    print(f"\n{model.name}: {args.requests} requests x {args.max_tokens} tokens, concurrency {args.concurrency}, "
          f"GPU {args.gpu}, gpu_memory_utilization {args.gpu_mem}, max_model_len {args.max_model_len}")
    print(lib.table(summaries, rat))
    short = [label for label, s in summaries.items() if not s["full_length"]]
    if short:
        print(f"!!! not every request generated {args.max_tokens} tokens on: {', '.join(short)}", flush=True)
    result = {"bench": "vs_vllm_serve", "model": str(model), "requests": args.requests,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, "rounds": args.rounds,
              "pairs": args.pairs, "infer_batch": args.infer_batch, "gpu_mem": args.gpu_mem,
              "max_model_len": args.max_model_len, "servers": summaries, "ratio_vs_vllm_serve": rat,
              "failed": failed}
    if args.out:
        full = {**result, "facts": facts,
                "rounds_detail": {k: [r.summary() for r in v] for k, v in rounds.items()}}
        Path(args.out).write_text(json.dumps(full, indent=1))
    print(json.dumps(result))
    return 1 if short or failed or not summaries else 0


if __name__ == "__main__":
    sys.exit(main())
