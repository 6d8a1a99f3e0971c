"""``python -m evaluator --model DIR | --checkpoint RUN/checkpoints/N --data VAL.jsonl --out OUT_DIR [...]``

Parses and checks the arguments (``evaluator/args.py``: every problem reported at once, each naming
the flag and the fix), then imports the heavy parts (httpx, transformers' tokenizer, pycocotools) and
calls ``evaluator.run.run``. Exit codes: 0 ok, 1 runtime failure, 2 bad arguments.
"""

from __future__ import annotations

import sys

from common.runs import cli
from evaluator.args import build_parser, check_args


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage and the problem
        return int(exc.code or 0)
    problems = check_args(args)
    if problems:
        print("evaluator: bad arguments:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return cli.EXIT_USAGE
    cli.setup_process("evaluator")
    from evaluator.run import run  # deferred: httpx, transformers' tokenizer, pycocotools

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
