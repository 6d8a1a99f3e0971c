"""Run a named benchmark scenario (``bench/scenarios/<name>.yaml``) on this machine, or list them.

    python3 bench/run_scenario.py --list
    python3 bench/run_scenario.py NAME [--set KEY=VALUE ...] [--out DIR] [--dry-run] [-- ARG ...]

A scenario file says what it measures (``what``), what the machine needs (``needs: {gpus: N, vllm: bool}``),
roughly how long it takes (``minutes``), its knobs with defaults (``params``, changed with ``--set``), the
inputs it builds where missing (``assets``: models, data, the tiny detector; see ``ASSETS``), and its
``steps``: shell commands run one after the other from the repo root, each under its own deadline
(``deadline_s``; SIGTERM, then SIGKILL ``kill_after_s`` later). A step that fails or times out is logged and
the scenario goes on with the next one; the exit code is 1 when any step failed. ``for_each: PARAM`` runs a
step once per comma-separated item of that param (``$ITEM`` in its command). ``budget_s`` caps the whole
scenario: a step's deadline is cut to what is left, and a step with < 15 s left is skipped. ``bundle`` lists
paths (globs) packed into ``$OUT/logs.tar.gz`` at the end (log files cut to their last 3000 lines), for
machines that return few files.

Commands see ``$OUT`` (default ``/tmp/tandem-bench/<name>``), ``$MODELS`` and ``$DATA`` (where the GPU configs
read their models and data), every param, and ``$ARGS`` (what follows ``--``). Everything a step prints goes
to ``$OUT/scenario.log`` (and to stdout with ``--echo``). Before anything runs, the machine is checked: a
scenario that needs more GPUs than ``nvidia-smi`` lists, or vLLM where it is not importable, is refused with
what is missing (exit 2).
Results go to ``docs/benchmarks.md`` by hand, under the scenario's name; this runner keeps no history.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = REPO / "bench" / "scenarios"
MODELS, DATA = "/tmp/tandem-models", "/tmp/tandem-data/synth"  # what configs/gpu/*.yaml read
#: Every scenario's environment where this process's own does not set the name. NCCL_NVLS_ENABLE and the two
#: multicast switches keep NVLink multicast off, which the lent GPU machines require (export them to change it).
ENV = {"PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "NCCL_NVLS_ENABLE": "0",
       "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_SYNTH, _MODEL = "python3 -m common.data.synthetic", "python3 tools/make_tiny_model.py"
#: name -> (the file whose presence means it is built, the command that builds it)
ASSETS = {
    "tiny-model": ("artifacts/tiny-model/tandem_build.json",
                   f"{_MODEL} --out artifacts/tiny-model"),
    "model-0.5b": ("$MODELS/0.5b/tandem_build.json", f"{_MODEL} --preset 0.5b --out $MODELS/0.5b"),
    "model-1.5b": ("$MODELS/1.5b/tandem_build.json", f"{_MODEL} --preset 1.5b --out $MODELS/1.5b"),
    # 7B weights in RAM, drawn from a pool: a 14 GB write through transformers' init takes minutes on a slow disk
    "model-1.5b-shm": ("/dev/shm/tandem-models/1.5b/tandem_build.json",
                       f"{_MODEL} --preset 1.5b --init pool --out /dev/shm/tandem-models/1.5b"),
    "model-7b-shm": ("/dev/shm/tandem-models/7b/tandem_build.json",
                     f"{_MODEL} --preset 7b --init pool --out /dev/shm/tandem-models/7b"),
    "data-synth": ("$DATA/train.jsonl", f"{_SYNTH} --out $DATA --n 96 --seed 0"),
    "data-detect": ("artifacts/data/detect/train.jsonl", f"{_SYNTH} --out artifacts/data/detect --split 4096/64 "
                    "--seed 0 --sides 112 --max-objects 3 --size-range 0.25/0.6"),
    # a detector built elsewhere (`make tiny-detector` on a CPU box) travels in .gpu-carry/; else build it here
    "tiny-detector": ("artifacts/tiny-detector/tandem_build.json",
                      "if [ -d .gpu-carry/tiny-detector ]; then mkdir -p artifacts && cp -r .gpu-carry/tiny-detector "
                      "artifacts/; else make tiny-detector; fi"),
}
SCENARIO_KEYS = {"what", "needs", "minutes", "params", "assets", "steps", "budget_s", "bundle"}
STEP_KEYS = {"name", "run", "deadline_s", "kill_after_s", "for_each"}


class ScenarioError(ValueError):
    """A scenario file that does not say what the runner needs (the message names the file and the key)."""


@dataclass
class Scenario:
    name: str
    what: str
    gpus: int
    vllm: bool
    minutes: float
    steps: list[dict[str, Any]]
    params: dict[str, str] = field(default_factory=dict)
    assets: list[str] = field(default_factory=list)
    budget_s: float | None = None
    bundle: list[str] = field(default_factory=list)


def load(name: str) -> Scenario:
    path = SCENARIOS / f"{name}.yaml"
    if not path.is_file():
        raise ScenarioError(f"no scenario {name!r} ({path} is missing); `python3 bench/run_scenario.py --list`")
    raw = yaml.safe_load(path.read_text()) or {}
    problems = [f"unknown key {k!r}" for k in raw if k not in SCENARIO_KEYS]
    problems += [f"missing key {k!r}" for k in ("what", "needs", "minutes", "steps") if k not in raw]
    needs = raw.get("needs") or {}
    params = {k: "" if v is None else str(v) for k, v in (raw.get("params") or {}).items()}
    for i, step in enumerate(raw.get("steps") or []):
        problems += [f"steps[{i}]: unknown key {k!r}" for k in step if k not in STEP_KEYS]
        problems += [f"steps[{i}]: missing key {k!r}" for k in ("name", "run", "deadline_s") if k not in step]
        if step.get("for_each") and step["for_each"] not in params:
            problems.append(f"steps[{i}].for_each: {step['for_each']!r} is not a param")
    problems += [f"assets: unknown {a!r} (known: {', '.join(ASSETS)})"
                 for a in raw.get("assets") or [] if a not in ASSETS]
    if problems:
        raise ScenarioError(f"{path}: " + "; ".join(problems))
    return Scenario(name, " ".join(str(raw["what"]).split()), int(needs.get("gpus", 0)), bool(needs.get("vllm", False)),
                    float(raw["minutes"]), list(raw["steps"]), params, list(raw.get("assets") or []),
                    raw.get("budget_s"), list(raw.get("bundle") or []))


def names() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.yaml"))


def gpu_count() -> tuple[int, str]:
    """The GPUs ``nvidia-smi -L`` lists here, and how that was found out (for the refusal message)."""
    if shutil.which("nvidia-smi") is None:
        return 0, "nvidia-smi is not on PATH"
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return 0, f"nvidia-smi -L failed: {e}"
    n = sum(line.startswith("GPU ") for line in out.splitlines())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = min(n, len([x for x in visible.split(",") if x.strip()]))
    return n, f"nvidia-smi -L lists {n}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")


def refusal(sc: Scenario, gpus: tuple[int, str], has_vllm: bool) -> str | None:
    """Why this machine cannot run ``sc``, or None when it can."""
    missing = []
    if gpus[0] < sc.gpus:
        missing.append(f"{sc.gpus} GPU(s), this machine has {gpus[0]} ({gpus[1]})")
    if sc.vllm and not has_vllm:
        missing.append("vLLM importable (docs/gpu.md, vLLM on the lent GPU machines), and it is not")
    if not missing:
        return None
    return (f"scenario {sc.name!r} needs " + "; and ".join(missing) +
            f". Run it on a machine with {sc.gpus} GPU(s)" + (" and vLLM" if sc.vllm else "") + ".")


def expand(text: str, env: dict[str, str]) -> str:
    """``$VAR`` / ``${VAR}`` of ``env`` in an asset path (commands are expanded by bash itself)."""
    for k in sorted(env, key=len, reverse=True):
        text = text.replace("${" + k + "}", env[k]).replace("$" + k, env[k])
    return text


class Log:
    """``$OUT/scenario.log`` plus the ``=== [elapsed] ...`` lines echoed to stdout."""

    def __init__(self, path: Path, budget_s: float | None):
        self.path, self.budget_s, self.t0 = path, budget_s, time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> int:
        return int(time.monotonic() - self.t0)

    def say(self, line: str) -> None:
        line = f"=== [{self.elapsed()}s] {line}"
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def _stop(proc: subprocess.Popen, kill_after_s: float, timed_out: list[bool]) -> None:
    """The deadline: SIGTERM to the step's process group, SIGKILL ``kill_after_s`` later if it is still there."""
    timed_out.append(True)
    with contextlib.suppress(ProcessLookupError):  # the group may have ended just now
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=kill_after_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def run_step(log: Log, name: str, command: str, deadline_s: float, env: dict[str, str], kill_after_s: float = 10,
             echo: bool = False) -> int | None:
    """One step under its deadline, its output into the log (and to stdout with ``echo``); its exit code (124 on
    the deadline), None when the budget left no time for it."""
    if log.budget_s is not None:
        left = int(log.budget_s - log.elapsed() - kill_after_s - 5)
        if left < 15:
            log.say(f"{name} SKIPPED: {left}s left of the {int(log.budget_s)}s budget")
            return None
        deadline_s = min(deadline_s, left)
    log.say(f"{name} (deadline {int(deadline_s)}s): {command}")
    timed_out: list[bool] = []
    with open(log.path, "ab") as out:
        # its own process group, so that the deadline reaches every child it starts
        proc = subprocess.Popen(["bash", "-c", command], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        timer = threading.Timer(deadline_s, _stop, (proc, kill_after_s, timed_out))
        timer.start()
        try:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                if echo:
                    sys.stdout.buffer.write(line)
                    sys.stdout.flush()
            rc = proc.wait()
        finally:
            timer.cancel()
    rc = 124 if timed_out else rc
    log.say(f"{name} -> rc={rc}")
    return rc


def bundle(out: Path, patterns: list[str], env: dict[str, str]) -> Path:
    """``out/logs.tar.gz`` of what exists: logs cut to their last 3000 lines, JSON under 4 MB."""
    target = out / "logs.tar.gz"
    with tempfile.TemporaryDirectory() as stage, tarfile.open(target, "w:gz") as tar:
        for pattern in patterns:
            for hit in sorted(glob.glob(expand(pattern, env), root_dir=REPO)):
                p = REPO / hit if not Path(hit).is_absolute() else Path(hit)
                for f in ([p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file())):
                    arc = f.relative_to(REPO) if f.is_relative_to(REPO) else f.relative_to(f.anchor)
                    if f.suffix in (".log", ".txt", ".out"):
                        cut = Path(stage) / arc
                        cut.parent.mkdir(parents=True, exist_ok=True)
                        cut.write_text("\n".join(f.read_text(errors="replace").splitlines()[-3000:]) + "\n")
                        tar.add(cut, arcname=str(arc))
                    elif f.suffix in (".json", ".jsonl", ".png") and f.stat().st_size < 4_000_000:
                        tar.add(f, arcname=str(arc))
    return target


def plan(sc: Scenario, env: dict[str, str]) -> list[tuple[str, str, float, float]]:
    """(name, command, deadline, kill-after) of every step, assets first (only those not built yet)."""
    steps = []
    for a in sc.assets:
        marker, command = ASSETS[a]
        if not (REPO / expand(marker, env)).is_file():
            steps.append((f"asset {a}", command, 600.0, 10.0))  # the tiny detector's build: ~4 min on 2 cores
    for s in sc.steps:
        items = [x.strip() for x in env[s["for_each"]].split(",") if x.strip()] if s.get("for_each") else [None]
        for item in items:
            cmd = s["run"].strip() if item is None else f"ITEM={item}\n{s['run'].strip()}"
            steps.append((s["name"] if item is None else f"{s['name']} {item}", cmd, float(s["deadline_s"]),
                          float(s.get("kill_after_s", 10))))
    return steps


def environment(sc: Scenario, sets: dict[str, str], out: Path, args: list[str]) -> dict[str, str]:
    unknown = sorted(set(sets) - set(sc.params))
    if unknown:
        raise ScenarioError(f"scenario {sc.name!r} has no param {', '.join(unknown)} (its params: "
                            f"{', '.join(sc.params) or 'none'})")
    pythonpath = os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"), str(REPO)) if x)
    return {**ENV, **os.environ, "PYTHONPATH": pythonpath, "OUT": str(out), "MODELS": MODELS, "DATA": DATA,
            "ARGS": " ".join(args), **sc.params, **sets}


def list_scenarios() -> str:
    rows = ["| name | GPUs | vLLM | minutes | what |", "|---|---|---|---|---|"]
    for n in names():
        sc = load(n)
        rows.append(f"| {n} | {sc.gpus} | {'yes' if sc.vllm else 'no'} | {sc.minutes:g} | {sc.what} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?")
    ap.add_argument("--list", action="store_true", help="the scenarios, what each measures and needs")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a param (repeatable)")
    ap.add_argument("--out", help="results and the log (default /tmp/tandem-bench/NAME)")
    ap.add_argument("--dry-run", action="store_true", help="print the steps, check nothing, run nothing")
    ap.add_argument("--echo", action="store_true", help="print what the steps print, too (default: the log only)")
    args = ap.parse_args(argv)
    if args.list or not args.name:
        print(list_scenarios())
        return 0 if args.list else 2
    try:
        sc = load(args.name)
        sets = dict(s.split("=", 1) for s in args.set if "=" in s)
        if len(sets) != len(args.set):
            raise ScenarioError(f"--set takes KEY=VALUE, got {args.set}")
        out = Path(args.out or f"/tmp/tandem-bench/{sc.name}").resolve()
        env = environment(sc, sets, out, extra)
    except ScenarioError as e:
        print(f"run_scenario: {e}", file=sys.stderr)
        return 2
    steps = plan(sc, env)
    if args.dry_run:
        for name, cmd, deadline, _ in steps:
            print(f"# {name} (deadline {int(deadline)}s)\n{cmd}")
        return 0
    why = refusal(sc, gpu_count() if sc.gpus else (0, ""), importlib.util.find_spec("vllm") is not None)
    if why:
        print(f"run_scenario: {why}", file=sys.stderr)
        return 2
    log = Log(out / "scenario.log", sc.budget_s)
    log.say(f"scenario {sc.name}: {sc.what} (params {sc.params | sets}; results in {out})")
    if sc.gpus:
        run_step(log, "env", "nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv; "
                 'python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())"',
                 60, env)
    failed = [n for n, cmd, deadline, kill in steps
              if run_step(log, n, cmd, deadline, env, kill, args.echo) not in (0, None)]
    if sc.bundle:
        log.say(f"bundled {bundle(out, sc.bundle, env)}")
    log.say(f"done; failed steps: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
