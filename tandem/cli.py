"""``tandem <command> [args ...]``: one console command in front of every tandem entry point.

    tandem launch --config configs/demo_cpu.yaml            # = python -m launcher --config ...
    tandem serve --config configs/demo_cpu.yaml             # = python -m rollout_server --config ...
    tandem learner --nproc-per-node 2 --config C            # = torchrun --nproc_per_node 2 learner/main.py ...

Each command calls its entry point's own ``main(argv)`` with the rest of the command line, so the
arguments, ``--help``, exit codes and log format are that entry point's (``common/runs/cli.py``). The
entry point is imported by module name only once chosen: ``tandem --help`` imports none of them. This
is the one package that reaches every process folder; the ``python -m ...``, ``torchrun ...`` and
``make ...`` invocations keep working unchanged and do the same thing.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
LEARNER_SCRIPT = REPO / "learner" / "main.py"


@dataclass(frozen=True)
class Command:
    module: str  # imported on use; its main(argv) -> int runs the command
    summary: str  # the one line `tandem --help` shows


COMMANDS: dict[str, Command] = {
    "launch": Command("launcher.__main__", "the whole topology (rollout server, learner, actors), supervised"),
    "serve": Command("rollout_server.__main__", "the rollout server alone"),
    "actor": Command("actor.__main__", "one Channel-B actor feeding one learner rank"),
    "learner": Command("learner.main", "the learner ranks (--nproc-per-node N, default 1)"),
    "eval": Command("evaluator.__main__", "F1@0.5, COCO mAP and parse failures of a model dir or checkpoint"),
    "stage-b": Command("stage_b.launch", "Stage-B on a list of GPUs"),
    "plot": Command("launcher.plot", "a run's metrics.jsonl as PNGs"),
    "summary": Command("launcher.summary", "a run's summary (what the launcher prints at the end)"),
    "warm-start": Command("learner.warm_start", "Stage-1 warm start: teach a model dir the coord-token boxes"),
    "data": Command("common.data.cli", "training data: synth, convert (COCO/LVIS/ODVG), check, stats"),
    "tiny-model": Command("tools.make_tiny_model", "a tiny Qwen2.5-VL or (--family qwen3-vl) Qwen3-VL model dir (random weights, coord tokens)"),
    "coord-tokens": Command("tools.add_coord_tokens", "add the 1000 coord tokens to a checkpoint"),
    "tickets": Command("tools.make_tickets", "the Stage-B demo ticket set as JSONL"),
    "compose": Command("launcher.compose", "a docker compose file for a config"),
    "config": Command("common.config.docs", "the config reference (--markdown) or a config resolved"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    return "\n".join(["usage: tandem <command> [args ...]", "",
                      "One command for every tandem entry point; `tandem <command> --help` shows that entry "
                      "point's own help.", "", "commands:", *rows])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f" (did you mean `tandem {close[0]}`?)" if close else ""
        print(f"tandem: unknown command {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    if name == "learner":
        return learner(rest)
    return entry_point(COMMANDS[name].module)(rest)


def entry_point(module: str) -> Callable[[list[str]], int]:
    """``module.main``, imported now (tools/ is no installed package: it is found from the repo root)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(module).main


def learner(argv: list[str]) -> int:
    """``--nproc-per-node 1`` (the default) runs learner/main.py's ``main`` in this process (W = 1, like
    ``python learner/main.py``); N > 1 replaces this process with ``torchrun --standalone`` (same pid:
    signals reach torchrun, and its exit code is the command's)."""
    ap = argparse.ArgumentParser(prog="tandem learner", add_help=False)  # --help: learner/main.py's own
    ap.add_argument("--nproc-per-node", type=int, default=1)
    args, rest = ap.parse_known_args(argv)
    if args.nproc_per_node < 1:
        ap.error(f"--nproc-per-node {args.nproc_per_node}: expected a rank count ≥ 1, e.g. 2")
    wants_help = "-h" in rest or "--help" in rest
    if wants_help:
        print("tandem learner [--nproc-per-node N] --config PATH [key=value ...]: N > 1 runs `torchrun --standalone\n"
              f"  --nproc_per_node N {LEARNER_SCRIPT} ...`; N = 1 (the default) runs it in this process.\n")
    if args.nproc_per_node == 1 or wants_help:
        return entry_point(COMMANDS["learner"].module)(rest)
    cmd = torchrun_command(args.nproc_per_node, rest)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """``torchrun --standalone --nproc_per_node=N learner/main.py ARGV`` (as the launcher starts it)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(LEARNER_SCRIPT), *argv]
