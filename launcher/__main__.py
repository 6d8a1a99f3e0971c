"""``python -m launcher --config PATH [--dry-run] [dotted overrides]``: the whole topology, supervised.

Validates the config, the GPU split, the first training records (``data.on_bad_record``) and the output directory
(``common/runs/output_dir.py``) before starting anything, starts the rollout server, the learner (torchrun) and the actors
(logs in ``{output_dir}/logs/``), restarts a dead actor or server within the ``launcher.*`` budgets, ends with the
learner, then prints the summary and the plot.
With ``launcher.node_rank=k`` (``learner.nnodes`` > 1) it starts learner node k's share (``launcher/plan.py``).
"""

from __future__ import annotations

import sys

from common.runs import cli
from common.data.check import start_problems
from common.runs.output_dir import StartRefused, prepare_start
from launcher.plan import PlanError, build_plan, node_log_dir, node_of  # light: the config schema, no torch


def main(argv: list[str] | None = None) -> int:
    ap = cli.config_parser("python -m launcher", "The whole topology (rollout server, learner, actors), supervised.")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the commands, start nothing")
    ap.add_argument("--no-server", action="store_true", help="use already running rollout servers")
    ap.add_argument("--grace-s", type=float, default=30.0, help="SIGTERM → SIGKILL grace at teardown")
    args = ap.parse_args(argv)
    cli.setup_process("launcher")
    if (cfg := cli.load(args.config, args.overrides)) is None:
        return cli.EXIT_USAGE
    try:
        specs = build_plan(cfg, args.config, args.overrides, node_log_dir(cfg), start_server=not args.no_server)
        # Before anything starts (no logs yet). Only node 0 (or the only node) moves an overwritten run aside:
        # the other nodes share output_dir (docs/multinode.md) and check it, never moving what node 0 started.
        prepare_start(cfg, move=not args.dry_run and not node_of(cfg))
        if not args.dry_run and (bad := start_problems(cfg)):  # data.on_bad_record: fail, before any process starts
            raise PlanError("bad training data:\n" + "\n".join(f"  - {p}" for p in bad))
    except (PlanError, StartRefused) as exc:
        print(f"launcher: {exc}", file=sys.stderr)
        return cli.EXIT_USAGE
    node = "" if node_of(cfg) is None else f" (learner node {node_of(cfg)} of {cfg.learner.nnodes})"
    print(f"tandem launcher{node}: {len(specs)} processes, output in {cfg.training.output_dir}")
    for spec in specs:
        print(f"  [{spec.name}] {spec.shell()}")
    if args.dry_run:
        return 0
    from launcher.supervisor import supervise

    return supervise(cfg, specs, grace_s=args.grace_s)


if __name__ == "__main__":
    sys.exit(main())
