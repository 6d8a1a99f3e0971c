"""Write the deterministic Stage-B demo ticket set as JSONL.

    python tools/make_tickets.py --out artifacts/stage_b/demo_tickets.jsonl [--num-groups 16] [--seed 0]

The same set the demo config generates in memory (``tickets.path: null``); write it to inspect it,
edit it, or pass it as ``tickets.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.runs import cli  # noqa: E402
from stage_b.tickets import make_demo_tickets, write_tickets  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser("python tools/make_tickets.py", __doc__)
    ap.add_argument("--out", required=True, help="JSONL file to write")
    ap.add_argument("--num-groups", type=int, default=16)
    ap.add_argument("--images-per-group", type=int, default=2)
    ap.add_argument("--fail-share", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    tickets = make_demo_tickets(a.num_groups, a.images_per_group, a.fail_share, a.seed)
    print(write_tickets(tickets, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
