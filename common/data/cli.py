"""``tandem data <synth|convert|check|stats>``: make, convert and check training data (docs/data.md).

    tandem data synth --out artifacts/data/synth --n 64            # the synthetic set (common/data/synthetic.py)
    tandem data convert --format coco --annotations A.json --images DIR --out OUT [--split val] ...
    tandem data check OUT/train.jsonl --config C [key=value ...]    # exit 1 on any bad record
    tandem data stats OUT/train.jsonl --config C                     # the same numbers, exit 0

``check`` and ``stats`` read ``data.coord_mode`` and ``data.image_root`` from the config, and, unless
``--no-tokens``, load ``model.path``'s processor (no weights) to count each sample's tokens (prompt with
its image tokens + the Channel-A answer) against ``training.global_max_length``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from common.runs import cli

SUBCOMMANDS = {
    "synth": "the deterministic synthetic detection set (python -m common.data.synthetic)",
    "convert": "COCO / LVIS / ODVG annotations -> JSONL records",
    "check": "validate every record of a JSONL (exit 1 on any problem)",
    "stats": "the same summary as check, without failing",
}


def usage() -> str:
    rows = [f"  {name:<8} {text}" for name, text in SUBCOMMANDS.items()]
    return "\n".join(["usage: tandem data <subcommand> [args ...]", "", *rows, "",
                      "`tandem data <subcommand> --help` shows its flags; docs/data.md the record contract."])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else cli.EXIT_USAGE
    sub, rest = argv[0], argv[1:]
    if sub == "synth":
        from common.data.synthetic import main as synth

        return synth(rest)
    if sub == "convert":
        return convert_main(rest)
    if sub in ("check", "stats"):
        return check_main(sub, rest)
    print(f"tandem data: unknown subcommand {sub!r}\n\n{usage()}", file=sys.stderr)
    return cli.EXIT_USAGE


def convert_main(argv: list[str]) -> int:
    from common.data.convert import FORMATS

    ap = cli.parser("tandem data convert", "COCO / LVIS / ODVG annotations -> JSONL records (docs/data.md).")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--annotations", required=True, type=Path, help="the instances JSON (coco, lvis) or JSONL (odvg)")
    ap.add_argument("--images", required=True, type=Path, help="the folder the annotations' file names are in")
    ap.add_argument("--out", required=True, type=Path, help="output folder: <split>.jsonl (+ images/<split>/)")
    ap.add_argument("--split", default="train", help="output name (default: %(default)s)")
    ap.add_argument("--coords", choices=("pixel", "norm1000"), default="pixel",
                    help="coordinate mode written into every record (default: %(default)s)")
    ap.add_argument("--max-side", type=int, default=None, help="resize so the longer side is at most this (px)")
    ap.add_argument("--multiple-of", type=int, choices=(28, 32), default=None,
                    help="round resized sides to this multiple (28: Qwen2/2.5-VL patches, 32: Qwen3-VL)")
    ap.add_argument("--max-objects", type=int, default=None, help="drop images with more objects (counted)")
    args = ap.parse_args(argv)
    if args.max_side is not None and args.max_side < (args.multiple_of or 1):
        ap.error(f"--max-side {args.max_side}: must be at least --multiple-of ({args.multiple_of or 1})")
    if args.max_objects is not None and args.max_objects < 1:
        ap.error(f"--max-objects {args.max_objects}: must be >= 1")
    cli.setup_logging("data")
    from common.data.convert import ConvertError, Options, convert

    try:
        path, stats = convert(Options(args.format, args.annotations, args.images, args.out, args.split, args.coords,
                                      args.max_side, args.multiple_of, args.max_objects))
    except ConvertError as exc:
        print(f"tandem data convert: {exc}", file=sys.stderr)
        return cli.EXIT_USAGE
    print(f"{path}: {stats.summary()}")
    return 0


def check_main(sub: str, argv: list[str]) -> int:
    ap = cli.parser(f"tandem data {sub}", "Check every record of a JSONL against the contract, its images, "
                    "the coordinate mode and the packing length.")
    ap.add_argument("jsonl", type=Path, help="the records to check")
    ap.add_argument("--config", required=True, metavar="PATH", help="the run's YAML (data.*, model.path, training.*)")
    ap.add_argument("--no-tokens", action="store_true", help="skip the token count (no processor is loaded)")
    ap.add_argument("overrides", nargs="*", metavar="key=value",
                    help="dotted config overrides, e.g. data.coord_mode=norm1000")
    args = ap.parse_intermixed_args(argv)  # the JSONL first, the overrides anywhere after it
    if not args.jsonl.is_file():
        ap.error(f"{args.jsonl}: no such file")
    # data.train_jsonl is required by the schema; the file checked here stands in for it unless overridden.
    if (cfg := cli.load(args.config, [f"data.train_jsonl={args.jsonl}", *args.overrides])) is None:
        return cli.EXIT_USAGE
    cli.setup_logging("data")
    from common.data.check import check_file, image_root_of

    encoder = None
    if not args.no_tokens:
        if not (Path(cfg.model.path) / "config.json").is_file():
            print(f"tandem data {sub}: model.path = {cfg.model.path}: no model directory there (its processor counts "
                  "the tokens). Fix: pass model.path=DIR, or --no-tokens to skip the token count", file=sys.stderr)
            return cli.EXIT_USAGE
        from common.detection.answer import Prompts
        from common.packing.encode import Encoder  # deferred: transformers

        encoder = Encoder(cfg.model.path, cfg.training.global_max_length,
                          image_root=image_root_of(args.jsonl, cfg.data.image_root),
                          check_coord_tokens=cfg.model.coord_tokens,
                          prompts=Prompts.of(cfg.data.system_prompt, cfg.data.user_prompt, cfg.data.answer_format),
                          min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    report = check_file(args.jsonl, coord_mode=cfg.data.coord_mode, image_root=cfg.data.image_root, encoder=encoder,
                        desc_ce_weight=cfg.stage2_ab.desc_ce_weight)
    print(report.summary())
    if sub == "check" and (report.bad or report.records == 0):
        print(f"tandem data check: {report.bad} of {report.records} records would not train (see above)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
