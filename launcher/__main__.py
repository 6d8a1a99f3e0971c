"""``python -m launcher --config PATH [--dry-run] [dotted overrides]``: the whole topology, supervised.

Validates the config, the GPU split and the output directory (``common/run_dir.py``) before starting anything,
starts the rollout server, the learner (torchrun) and the actors (logs in ``{output_dir}/logs/``), restarts a dead
actor or server within the ``launcher.*`` budgets, ends with the learner, then prints the summary and the plot.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from common import cli
from common.run_dir import StartRefused, prepare_start
from launcher.plan import PlanError, build_plan  # light: the config schema, no torch


def main(argv: list[str] | None = None) -> int:
    ap = cli.config_parser("python -m launcher", "The whole topology (rollout server, learner, actors), supervised.")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the commands, start nothing")
    ap.add_argument("--no-server", action="store_true", help="use already running rollout servers")
    ap.add_argument("--grace-s", type=float, default=30.0, help="SIGTERM → SIGKILL grace at teardown")
    args = ap.parse_args(argv)
    cli.setup_process("launcher")
    if (cfg := cli.load(args.config, args.overrides)) is None:
        return cli.EXIT_USAGE
    out = Path(cfg.training.output_dir)
    try:
        specs = build_plan(cfg, args.config, args.overrides, out / "logs", start_server=not args.no_server)
        prepare_start(cfg, move=not args.dry_run)  # the learner's own check, before anything starts (no logs yet)
    except (PlanError, StartRefused) as exc:
        print(f"launcher: {exc}", file=sys.stderr)
        return cli.EXIT_USAGE
    print(f"tandem launcher: {len(specs)} processes, output in {out}")
    for spec in specs:
        print(f"  [{spec.name}] {spec.shell()}")
    if args.dry_run:
        return 0
    from launcher.summary import print_summary
    from launcher.supervisor import Supervisor

    sup = Supervisor(specs, health_timeout_s=cfg.rollout_matching.vllm.timeout_s, grace_s=args.grace_s)
    t0 = time.monotonic()
    code = sup.run()
    sup.write_record(out / "processes.json")
    print_summary(out, wall_s=time.monotonic() - t0, exit_codes=sup.exit_codes())
    try:
        from launcher.plot import plot_run

        for png in plot_run(out):
            print(f"plot: {png}")
    except Exception as exc:  # the plot is a convenience; never fail the run for it
        logging.getLogger("tandem.launcher").warning("plot failed: %s", exc)
    return code


if __name__ == "__main__":
    sys.exit(main())
