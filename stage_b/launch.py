"""Launch Stage-B on a comma-separated GPU list (``make stage-b GPUS=0,1``).

    python -m stage_b.launch --gpus 0,1 --config configs/stage_b/demo_cpu.yaml [--dry-run] [key=value ...]

One GPU runs a plain ``python stage_b/main.py`` with ``CUDA_VISIBLE_DEVICES`` set; several run
``torchrun --nnodes=1 --nproc_per_node=N stage_b/main.py`` (single node; each rank gets its local
GPU, WORLD_SIZE = N). torchrun tears every rank down when one fails, and Stage-B itself makes all
ranks exit non-zero on a failure anywhere, so the launcher's exit code is the run's.
On a machine without CUDA the same commands run the ranks on CPU (gloo), e.g. ``--gpus 0,1``
starts two CPU ranks.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from common.runs import cli

REPO = Path(__file__).resolve().parents[1]


def parse_gpus(text: str) -> list[str]:
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if not gpus or not all(g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus {text!r}: expected distinct GPU ids separated by commas, e.g. 0 or 0,1,2,3")
    return gpus


def build_command(gpus: list[str], config: str, overrides: list[str], master_port: int | None = None
                  ) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) for the run."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    entry = [str(REPO / "stage_b" / "main.py"), "--config", config, *overrides]
    if len(gpus) == 1:
        return [sys.executable, *entry], env
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={len(gpus)}"]
    if master_port is not None:
        cmd.append(f"--master_port={master_port}")
    else:
        cmd.append("--standalone")  # a free rendezvous port on this node
    return [*cmd, *entry], env


def main(argv: list[str] | None = None) -> int:
    ap = cli.config_parser("python -m stage_b.launch", __doc__, config_help="Stage-B YAML, e.g. configs/stage_b/demo_cpu.yaml")
    ap.add_argument("--gpus", required=True, help="comma-separated GPU ids, e.g. 0 or 0,1,2,3")
    ap.add_argument("--master-port", type=int, default=None, help="torchrun rendezvous port (default: --standalone)")
    ap.add_argument("--dry-run", action="store_true", help="print the command and exit")
    args = ap.parse_args(argv)
    try:
        gpus = parse_gpus(args.gpus)
    except ValueError as exc:
        ap.error(str(exc))
    cmd, env = build_command(gpus, args.config, args.overrides, args.master_port)
    line = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(cmd)
    print(line, flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd, env={**os.environ, **env}, cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())
