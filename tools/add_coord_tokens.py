"""Copy a checkpoint with the 1000 ``<|coord_k|>`` tokens added to its tokenizer and embeddings.

    python tools/add_coord_tokens.py --model /ckpt/Qwen2.5-VL-3B-Instruct --out /ckpt/Qwen2.5-VL-3B-Instruct-coord

tandem refuses a tokenizer without the coord tokens (``common/detection/coord_tokens.py``); this is the fix.

- The tokens are appended as added, non-special tokens (``decode(skip_special_tokens=True)`` keeps
  them), so their ids are contiguous in bin order right after the existing tokenizer.
- Embedding rows grow to cover them, rounded up to a multiple of 64 and never shrunk (Qwen checkpoints
  already carry spare rows past the tokenizer, e.g. 151936 rows for 151665 tokens).
- Every coord row, input and output embedding alike, starts at the mean of the rows of the existing
  tokens (spare rows excluded), a neutral start that fine-tuning moves; tied embeddings are set once.
- The model is loaded and saved in its own dtype (``--dtype auto``). A 3B checkpoint needs ~8 GB of
  RAM and a minute on CPU; no GPU is used.
- Processor files that ``save_pretrained`` does not rewrite (image/video processor configs, chat
  template) are copied over unchanged.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as `python tools/add_coord_tokens.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.runs import cli  # noqa: E402
from common.data.records import COORD_TOKENS, NUM_BINS  # noqa: E402
from common.detection.coord_tokens import contiguous_range, coord_token_ids  # noqa: E402

ROW_MULTIPLE = 64
_CARRIED_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


class AddCoordTokensError(RuntimeError):
    """The checkpoint cannot get coord tokens as asked; the message says why and what to do."""


def _load_model(path: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs = {"dtype": "auto" if dtype == "auto" else getattr(torch, dtype)}
    try:
        return AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    except ValueError:  # a text-only checkpoint: not in the image-text-to-text mapping
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def add_coord_tokens(model: str | Path, out: str | Path, *, dtype: str = "auto", force: bool = False) -> dict:
    """Write ``out`` = ``model`` + coord tokens; return a summary (ids, rows before/after)."""
    import torch
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    src, dst = Path(model), Path(out)
    if src.resolve() == dst.resolve():
        raise AddCoordTokensError(f"--out must differ from --model ({src}); the source is left untouched")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise AddCoordTokensError(f"{dst} exists and is not empty; remove it or pass --force")
    tokenizer = AutoTokenizer.from_pretrained(src)
    vocab = tokenizer.get_vocab()
    present = sum(t in vocab for t in COORD_TOKENS)
    if present == NUM_BINS:
        raise AddCoordTokensError(f"{src} already has the {NUM_BINS} coord tokens; use it as is")
    if present:
        raise AddCoordTokensError(
            f"{src} has {present} of the {NUM_BINS} coord tokens; a partial set cannot be completed in bin order, "
            "start from the checkpoint without them"
        )
    n_before = len(tokenizer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in COORD_TOKENS])
    ids = coord_token_ids(tokenizer)

    net = _load_model(src, dtype)
    rows_before = net.get_input_embeddings().weight.shape[0]
    rows_after = max(rows_before, -(-len(tokenizer) // ROW_MULTIPLE) * ROW_MULTIPLE)
    if rows_after != rows_before:
        net.resize_token_embeddings(rows_after, mean_resizing=False)
    index = torch.tensor(ids)
    with torch.no_grad():
        emb_in = net.get_input_embeddings().weight
        emb_in[index] = emb_in[:n_before].float().mean(0).to(emb_in.dtype)
        emb_out = net.get_output_embeddings()
        if emb_out is not None and emb_out.weight.data_ptr() != emb_in.data_ptr():
            w = emb_out.weight
            w[index] = w[:n_before].float().mean(0).to(w.dtype)
            if getattr(emb_out, "bias", None) is not None:
                emb_out.bias[index] = emb_out.bias[:n_before].float().mean().to(emb_out.bias.dtype)

    dst.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    for name in _CARRIED_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)
    return {
        "coord_id_range": contiguous_range(ids),
        "tokenizer_size": (n_before, len(tokenizer)),
        "embedding_rows": (rows_before, rows_after),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser("python tools/add_coord_tokens.py", __doc__)
    parser.add_argument("--model", required=True, help="checkpoint directory without coord tokens")
    parser.add_argument("--out", required=True, help="directory to write the extended checkpoint to")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="dtype to load and save in (default: the checkpoint's own)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty --out")
    args = parser.parse_args(argv)
    try:
        summary = add_coord_tokens(args.model, args.out, dtype=args.dtype, force=args.force)
    except AddCoordTokensError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    (tok_before, tok_after), (rows_before, rows_after) = summary["tokenizer_size"], summary["embedding_rows"]
    print(
        f"wrote {args.out}: coord ids {summary['coord_id_range']}, tokenizer {tok_before} -> {tok_after}, "
        f"embedding rows {rows_before} -> {rows_after}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
