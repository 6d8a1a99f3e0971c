"""One evaluation run: records → (own or given) rollout server → report.json + predictions.png + summary.

    load_eval_set(--data) ──► tokenizer + coord ids of the model dir
        │
        ├─ --url given: HttpInfer(url).wait_healthy   (deadline --server-timeout)
        └─ else: python -m rollout_server (hf engine, CPU, free loopback port, log in OUT/rollout_server.log)
                 wait for GET /health 200 (deadline --server-timeout; a server that exits is reported at once)
        │
        ▼  start check: the server's engine_info.image_pixels = --config's data.min/max_pixels for the model
        ▼
    evaluate_records (batches of --batch-size; each /infer waits at most --infer-timeout)
        ▼
    OUT/report.json, OUT/predictions.png, one summary paragraph on stdout
    finally: the own server gets SIGTERM by PID (SIGKILL after 20 s)

SIGTERM to the evaluator raises SystemExit, so the ``finally`` that stops the own server runs.
What this module does not know: how metrics are computed (common.evaluation.metrics) or drawn (draw.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.detection.answer import Prompts
from common.evaluation.loop import EvalResult, HttpInfer, InferError, evaluate_records, load_eval_set
from common.detection.coord_tokens import CoordTokenError, require_coord_tokens

log = logging.getLogger("evaluator")

REPO = Path(__file__).resolve().parents[1]
STOP_DEADLINE_S = 20.0
BIND_FAILED = 4  # rollout_server's exit code when it cannot bind the port (python -m rollout_server docs)


class EvalFailure(RuntimeError):
    """A runtime failure with a message that says what to do (exit code 1)."""


@dataclass
class OwnServer:
    """A rollout server subprocess this run started; stopped by its PID only."""

    proc: subprocess.Popen
    url: str
    argv: list[str]
    log_path: Path

    def command(self) -> str:
        return " ".join(self.argv)

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:]) or "(log empty)"

    def gone(self) -> str | None:
        """Why the server is not running (None while it is)."""
        if self.proc.poll() is None:
            return None
        return f"(pid {self.proc.pid}) exited with code {self.proc.returncode} during start; log {self.log_path}"

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            log.warning("rollout server pid %d ignored SIGTERM for %.0f s; killing it", self.proc.pid, STOP_DEADLINE_S)
            self.proc.kill()
            self.proc.wait(timeout=STOP_DEADLINE_S)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, config: str, log_path: Path, *, batch_size: int) -> OwnServer:
    """``python -m rollout_server`` with the hf engine on CPU on a free loopback port (returns at once)."""
    port = _free_port()
    argv = [sys.executable, "-m", "rollout_server", "--config", config, "rollout_server.engine=hf",
            "rollout_server.host=127.0.0.1", f"rollout_server.port={port}", "rollout_server.device=cpu",
            f"rollout_server.hf_max_batch={batch_size}", f"model.path={model_dir}",
            f"rollout_server.model_path={model_dir}", "rollout_server.log_level=warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error"}
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    log.info("started rollout server pid %d on port %d (log %s)", proc.pid, port, log_path)
    return OwnServer(proc=proc, url=f"http://127.0.0.1:{port}", argv=argv, log_path=log_path)


def _serve_own(args: argparse.Namespace, out: Path, servers: list[OwnServer]) -> tuple[HttpInfer, Any]:
    """Start our server (a second port if the first was taken meanwhile) and wait until it serves."""
    for attempt in range(2):
        srv = start_server(args.model_dir, args.config, out / "rollout_server.log", batch_size=args.batch_size)
        servers.append(srv)
        client = HttpInfer(srv.url, timeout_s=args.infer_timeout, start_hint=srv.command())
        try:
            return client, client.wait_healthy(args.server_timeout, alive=srv.gone)
        except (TimeoutError, RuntimeError) as exc:
            client.close()
            if srv.proc.poll() == BIND_FAILED and attempt == 0:
                log.warning("port of %s was taken before the server bound it; trying another", srv.url)
                continue
            hint = f" (--server-timeout {args.server_timeout:g})" if isinstance(exc, TimeoutError) else ""
            raise EvalFailure(f"{exc}{hint}\n  command: {srv.command()}\n"
                              f"  last lines of {srv.log_path}:\n"
                              + "\n".join("    " + line for line in srv.log_tail().splitlines())) from None
    raise AssertionError("unreachable")


def config_prompts(config: str) -> Prompts:
    """The prompts the model was trained with: ``data.system_prompt`` / ``data.user_prompt`` of ``--config``."""
    from common.config.load import ConfigError, load_config

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        raise EvalFailure(f"--config {config}: {exc}") from None
    return Prompts.of(cfg.data.system_prompt, cfg.data.user_prompt, cfg.data.answer_format)


def config_coord_mode(config: str) -> str | None:
    """``data.coord_mode`` of ``--config``: how --data records without their own coord_mode are read (None: each
    record must carry one). A config that does not load gives None here: the rollout server started with it (or
    config_prompts) reports its problems."""
    from common.config.load import ConfigError, load_config

    try:
        return load_config(config).data.coord_mode
    except ConfigError:
        return None


def config_pixels(config: str) -> tuple[int | None, int | None]:
    """``data.min_pixels`` / ``data.max_pixels`` of ``--config`` (None = the model's own); a config that does not
    load gives (None, None) here, as in config_coord_mode."""
    from common.config.load import ConfigError, load_config

    try:
        data = load_config(config).data
    except ConfigError:
        return None, None
    return data.min_pixels, data.max_pixels


def check_server_pixels(health: Any, model_dir: Path, config: str, url: str) -> dict[str, Any]:
    """The start check: the server must resize images as ``--config`` says for ``model_dir`` (the image tokens the
    model was trained on); raises EvalFailure naming the difference and the fix. Returns report.json's
    ``image_size``."""
    from common.data import image_size

    lo, hi = config_pixels(config)
    try:
        ours = image_size.resolve(model_dir, lo, hi)
    except image_size.ImageSizeError as exc:
        raise EvalFailure(f"--config {config}: {exc}") from None
    served = (health.engine_info or {}).get("image_pixels")
    why = image_size.mismatch(served, ours, url=url, config=config)
    if why:
        raise EvalFailure(why)
    return {"data.min_pixels": lo, "data.max_pixels": hi, "served": served,
            "expected": ours.as_dict() if ours else None}


def _checkpoint_info(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.checkpoint:
        return None
    info: dict[str, Any] = {"path": str(Path(args.checkpoint).resolve())}
    state = Path(args.checkpoint) / "trainer_state.json"
    if state.is_file():
        try:
            st = json.loads(state.read_text())
            info.update(step=st.get("global_step"), ver=st.get("ver"))
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s: %s", state, exc)
    return info


def _fmt(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:.1f} %" if pct else f"{v:.3f}"


def summary(result: EvalResult, *, data: str, n_skipped: int, model: str, server: str, out: Path, png: bool) -> str:
    r = result.report
    ver = str(result.ver_max) if result.ver_min == result.ver_max else f"{result.ver_min}..{result.ver_max}"
    skipped = f", {n_skipped} lines skipped" if n_skipped else ""
    drawn = f", drawing {out / 'predictions.png'}" if png else ""
    return (f"evaluated {r.n_images} images of {data}{skipped} with {model} at ver {ver} ({server}): "
            f"F1@0.5 {_fmt(r.f1)} (P {_fmt(r.precision)}, R {_fmt(r.recall)}), mAP {_fmt(r.map)}, "
            f"mAP50 {_fmt(r.map_50)}, per-class mAP {_fmt(r.map_per_class)} over {len(r.ap_by_class)} classes"
            + (f", LVIS AP {_fmt(r.lvis_map)}" if r.lvis_map is not None else "") +
            f", parse failures {_fmt(r.parse_failure_rate, True)}, "
            f"truncated {_fmt(r.truncated_rate, True)}, objects/image {r.objects_per_image:.2f} "
            f"(GT {r.gt_per_image:.2f}), scores {r.score_source}, {result.elapsed_s:.1f} s. "
            f"Report {out / 'report.json'}{drawn}." + ("".join(f" Note: {n}." for n in r.notes)))


def run(args: argparse.Namespace) -> int:
    """Evaluate; 0 ok, 1 runtime failure, 2 a model without coord tokens (a bad --model)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    servers: list[OwnServer] = []
    client: HttpInfer | None = None
    try:
        evalset = load_eval_set(args.data, max_images=args.max_images, image_root=args.image_root,
                                coord_mode=config_coord_mode(args.config))
        if not evalset.records:
            first = f"; first: {evalset.skipped[0]}" if evalset.skipped else ""
            raise EvalFailure(f"no usable records in {args.data} ({len(evalset.skipped)} lines skipped{first})")
        from transformers import AutoTokenizer  # deferred: heavy

        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        try:
            coord_ids = require_coord_tokens(tokenizer, args.model_dir)
        except CoordTokenError as exc:
            print(f"evaluator: bad arguments:\n  - --model/--checkpoint: {exc}", file=sys.stderr)
            return 2
        if args.url:
            client = HttpInfer(args.url, timeout_s=args.infer_timeout,
                               start_hint=f"python -m rollout_server --config {args.config}")
            try:
                health = client.wait_healthy(args.server_timeout)
            except TimeoutError as exc:
                raise EvalFailure(f"{exc} (--server-timeout {args.server_timeout:g}), or check --url") from None
            server_info = {"url": args.url, "started_by_evaluator": False}
        else:
            client, health = _serve_own(args, out, servers)
            server_info = {"url": client.url, "started_by_evaluator": True, "command": servers[-1].command(),
                           "log": str(servers[-1].log_path)}
        server_info.update(engine=health.engine, model=health.model, ver_at_start=health.ver)
        pixels = check_server_pixels(health, Path(args.model_dir), args.config, client.url)
        log.info("evaluating %d images on %s (%s engine, ver %d)", len(evalset.records), client.url, health.engine,
                 health.ver)

        prompts = config_prompts(args.config)
        log.info("prompts and config: %s, from %s", args.config, getattr(args, "config_source", "--config"))
        result = evaluate_records(evalset.records, client, tokenizer=tokenizer, coord_ids=coord_ids,
                                  image_root=evalset.image_root, max_new_tokens=args.max_new_tokens,
                                  batch_size=args.batch_size, prompts=prompts, federated=evalset.federated)
        png = False
        if args.grid > 0:
            from evaluator.draw import draw_predictions

            png = draw_predictions(result.images, out / "predictions.png", n=args.grid) is not None
        report = {
            "model": str(args.model_dir), "checkpoint": _checkpoint_info(args), "data": str(Path(args.data).resolve()),
            "image_root": evalset.image_root, "n_skipped_lines": len(evalset.skipped),
            "skipped_lines": evalset.skipped, "server": server_info, "ver": result.ver_max,
            "ver_min": result.ver_min, "ver_max": result.ver_max, "decoding": result.sampling,
            "config": {"path": args.config, "source": getattr(args, "config_source", "--config")},
            "prompts": {"system": prompts.system, "user": prompts.user}, "image_size": pixels,
            "max_images": args.max_images, "batch_size": args.batch_size, "eval_time_s": result.elapsed_s,
            "elapsed_s": time.monotonic() - t0, **result.report.as_dict(), "record": result.record(),
            "images": [im.as_dict() for im in result.images],
        }
        (out / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
        server_desc = f"{health.engine} engine, " + ("own server" if not args.url else args.url)
        print(summary(result, data=args.data, n_skipped=len(evalset.skipped), model=str(args.model_dir),
                      server=server_desc, out=out, png=png))
        return 0
    except (EvalFailure, InferError, TimeoutError, RuntimeError, OSError, ValueError) as exc:
        print(f"evaluator: {exc}", file=sys.stderr)
        return 1
    finally:
        if client is not None:
            client.close()
        for srv in servers:
            srv.stop()
