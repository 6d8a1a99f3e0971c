"""Build a Qwen2.5-VL or Qwen3-VL model directory from scratch: config, random weights, tokenizer, processor.

    python tools/make_tiny_model.py --out artifacts/tiny-model [--family qwen2.5-vl] [--seed 0] [--preset tiny]

``--family qwen3-vl`` builds ``Qwen3VLForConditionalGeneration`` instead, with the same tokenizer and chat
template; its presets and config are in ``tools/qwen3_vl_family.py``. What follows describes qwen2.5-vl.

Nothing is downloaded. The result is an ordinary HF model directory, loaded the way a real checkpoint
is (``AutoModelForImageTextToText`` / ``AutoTokenizer`` / ``AutoProcessor.from_pretrained(path)``):

- ``Qwen2_5_VLForConditionalGeneration`` (the real target architecture) with the sizes of ``--preset``; ``tiny``
  (default, ~0.9 M parameters, float32) is what CPU tests and the demo use; ``small`` (11.5 M, float32, rope_theta
  10 as tiny) is the GPU quality benchmark's detector for crowded scenes, where tiny plateaued at F1 0.008
  (docs/benchmarks.md section 21). The bigger presets have realistic Qwen2.5 shapes for GPU work; they are built on
  the meta device and materialised with transformers' own initialisation in bfloat16, so building the 7b preset
  costs memory and a minute of random-number generation, not an hour of per-module init (on the GPU image's CPU it
  took over 200 s; ``--init pool`` fills every weight from one pool of 16 M normal draws instead: 24 s for 7b there,
  for memory and speed work, not for learning).
- A byte-level BPE tokenizer trained here on a small generated corpus (the prompts, the assistant JSON, the
  synthetic data's words, common English), with Qwen2's pre-tokenizer, the Qwen chat special tokens
  (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ... ``<|image_pad|>``, ``<|video_pad|>``) and then the 1000
  ``<|coord_k|>`` tokens as added tokens with contiguous ids in bin order. Coord tokens are *not* special, so
  ``decode(..., skip_special_tokens=True)`` keeps them in the answer text. ``--no-coord-tokens`` leaves them out (to
  test ``tools/add_coord_tokens.py``).
- The standard Qwen2-VL chat template, the PIL Qwen2-VL image processor with ``min_pixels = 56*56`` and ``max_pixels
  = 112*112`` (a 112x112 image is 8x8 patches = 16 image tokens), and a generation config (greedy, eos
  ``<|im_end|>``, pad ``<|endoftext|>``).
- Embedding rows = tokenizer size rounded up to a multiple of 64 (``--vocab 151936``: a real checkpoint's rows, for
  timings at the operating point); word embeddings are tied for every preset but 7b, as in the Qwen2.5 checkpoints
  of those sizes. ``--max-pixels`` sets the processor's cap (1024² keeps 1024-px images).

``tandem_build.json`` records the build parameters; a later run with the same ones does nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as `python tools/make_tiny_model.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.runs import cli  # noqa: E402
from common.runs.build_dir import build_once  # noqa: E402
from common.detection.answer import (CHAT_SPECIAL_TOKENS, ENDOFTEXT, IM_END, IMAGE_PAD, SYSTEM_PROMPT,  # noqa: E402
                                     USER_PROMPT, VIDEO_PAD, VISION_END, VISION_START, serialize_objects)
from common.data.records import COORD_TOKENS, GTObject  # noqa: E402
from common.data.synthetic import desc_vocabulary  # noqa: E402
from tools import qwen3_vl_family as qwen3  # noqa: E402

BUILDER_VERSION = 2  # 2: tiny preset rope_theta 10
BUILD_FILE = "tandem_build.json"
EMBEDDING_ROW_MULTIPLE = 64
BPE_VOCAB_SIZE = 2048  # an upper bound: the corpus supports fewer merges

# The standard Qwen2-VL / Qwen2.5-VL chat template (as shipped with the Instruct checkpoints).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112

# Qwen2.5-VL vision tower (all real sizes share it); `out_hidden_size` is set to the text hidden size.
_VISION_REAL = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
)


def _text(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> dict:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=intermediate)


PRESETS: dict[str, dict] = {
    "tiny": dict(
        text=_text(128, 2, 4, 2, 256),
        # window_size 56 px = 2x2 merged patches, so the windowed layer really splits 56..112 px images.
        vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, window_size=56,
                    fullatt_block_indexes=[1]),
        tie=True, dtype="float32",
        # rope_theta 10, not Qwen's 1e6: the h/w sections of mRoPE get the low-frequency half of the rotary
        # dims, and at 1e6 a 4x4 grid of image tokens rotates by < 0.1 rad across the image, so the text
        # cannot tell where a token is. At 10 it can: the tiny detector's val F1@0.5 went 0.27 -> 0.46 in
        # the same 3000 warm-start steps (docs/warm_start.md).
        rope_theta=10.0,
    ),
    "small": dict(text=_text(384, 6, 6, 2, 1024), tie=True, dtype="float32", rope_theta=10.0,  # module doc
                  vision=dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, window_size=112,
                              fullatt_block_indexes=[1, 3])),
    # ~312 MB of float32 weights on the tiny vision tower: the HTTP weight-sync benchmark (bench/bench_http_sync.py)
    "sync-300mb": dict(text=_text(1024, 5, 8, 2, 4096), vision=dict(depth=2, hidden_size=64, intermediate_size=128,
                       num_heads=4, window_size=56, fullatt_block_indexes=[1]), tie=True, dtype="float32"),
    "0.5b": dict(text=_text(896, 24, 14, 2, 4864), vision=_VISION_REAL, tie=True, dtype="bfloat16"),
    "1.5b": dict(text=_text(1536, 28, 12, 2, 8960), vision=_VISION_REAL, tie=True, dtype="bfloat16"),
    "3b": dict(text=_text(2048, 36, 16, 2, 11008), vision=_VISION_REAL, tie=True, dtype="bfloat16"),  # Qwen2.5-VL-3B
    "7b": dict(text=_text(3584, 28, 28, 4, 18944), vision=_VISION_REAL, tie=False, dtype="bfloat16"),
}

_ENGLISH = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part over new sound take only little work know place year live me back give most very "
    "after thing our just name good sentence man think say great where help through much before line right "
    "too mean old any same tell boy follow came want show also around form three small set put end does "
    "another well large must big even such because turn here why ask went men read need land different home "
    "us move try kind hand picture again change off play spell air away animal house point page letter "
    "mother answer found study still learn should image object box left top bottom corner detect every color "
    "shape description position width height model answer json list key value token coordinate"
).split()


def mrope_section(head_dim: int) -> list[int]:
    """Split the rotary half-dimension into (temporal, height, width) like Qwen2.5-VL's [16, 24, 24]."""
    half = head_dim // 2
    t = half // 4
    hw = (half - t) // 2
    section = [t, hw, half - t - hw]
    assert sum(section) == half, section
    return section


def _corpus() -> Iterator[str]:
    """Deterministic BPE training text. Coord tokens are cut out: they are added tokens, never merged."""
    import random
    import re

    rng = random.Random(0)
    coord = re.compile(r"<\|coord_\d+\|>")
    words = desc_vocabulary()
    for _ in range(40):
        yield from coord.split(SYSTEM_PROMPT)
        yield from coord.split(USER_PROMPT)
        yield "system\nYou are a helpful assistant.\nuser\n\nassistant\n"
    for _ in range(400):
        objs = [
            GTObject(" ".join(rng.sample(words, rng.randint(1, 3))), tuple(sorted(rng.sample(range(1000), 4))))
            for _ in range(rng.randint(0, 14))
        ]
        yield from coord.split(serialize_objects(objs))
    for _ in range(300):
        yield " ".join(rng.choice(_ENGLISH) for _ in range(rng.randint(4, 16))).capitalize() + rng.choice(".,?!:;")
    yield "0123456789 " * 20 + "{}[]()<>\"'`~!@#$%^&*-_=+|\\/:;,.?"


def build_tokenizer(coord_tokens: bool = True):
    """Train the byte-level BPE and wrap it as the Qwen2 tokenizer class (what ``AutoTokenizer`` picks)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    raw = Tokenizer(BPE())
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is representable
        show_progress=False,
    )
    raw.train_from_iterator(_corpus(), trainer)
    # Added after training so their ids follow the BPE vocabulary, as in Qwen checkpoints.
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIAL_TOKENS])
    if coord_tokens:
        raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in COORD_TOKENS])
    tok = Qwen2Tokenizer(
        tokenizer_object=raw,
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=list(CHAT_SPECIAL_TOKENS[1:]),
        model_max_length=32768,
    )
    tok.chat_template = QWEN2_VL_CHAT_TEMPLATE
    return tok


def build_config(preset: str, tokenizer):
    from transformers import Qwen2_5_VLConfig

    spec = PRESETS[preset]
    text = dict(spec["text"])
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    names = (ENDOFTEXT, IM_END, IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in names}
    rows = -(-len(tokenizer) // EMBEDDING_ROW_MULTIPLE) * EMBEDDING_ROW_MULTIPLE
    text.update(
        vocab_size=rows,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": spec.get("rope_theta", 1000000.0),
                         "mrope_section": mrope_section(head_dim)},
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        tie_word_embeddings=spec["tie"],
    )
    vision = dict(
        spec["vision"], patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
        hidden_act="silu", tokens_per_second=2, out_hidden_size=text["hidden_size"],
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=spec["tie"],
        # Saved with the config even when no weights are (bench/bench_weight_sync.py's config-only dirs):
        # without it vLLM 0.26 resolved the architecture to a pooling adapter whose load_weights clones
        # every incoming tensor, so the fast load path was refused there (docs/gpu.md).
        architectures=["Qwen2_5_VLForConditionalGeneration"],
    )


POOL_VALUES = 1 << 24  # --init pool: one shared pool of normal draws (16 M values)


def pool_init(model, seed: int, std: float) -> None:
    """``--init pool``: every weight a slice of ONE pool of N(0, std) draws (at a seeded offset, tiled where
    longer), norm weights 1, biases 0. Writing a 7B model costs a memory copy instead of billions of
    random draws (minutes per module on the GPU image's CPU), for memory and speed work: the weights are
    finite and of the usual scale, not independent. Parameters only: the rotary buffers are recomputed
    whenever the directory is loaded (they are not saved)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(POOL_VALUES, generator=gen) * std
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                p.zero_()
            elif "norm" in name or "ln_" in name:
                p.fill_(1.0)
            else:
                flat, n = p.view(-1), p.numel()
                start = int(torch.randint(0, POOL_VALUES, (1,), generator=gen))
                reps = -(-(start + n) // POOL_VALUES)
                flat.copy_(pool.repeat(reps)[start:start + n] if reps > 1 else pool[start:start + n])


FAMILIES = ("qwen2.5-vl", "qwen3-vl")


def family_presets(family: str) -> dict[str, dict]:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    return qwen3.PRESETS if family == "qwen3-vl" else PRESETS


def build_family_config(family: str, preset: str, tokenizer):
    """The model config of ``family`` at ``preset`` for ``tokenizer``'s special-token ids and size."""
    if family == "qwen2.5-vl":
        return build_config(preset, tokenizer)
    names = (ENDOFTEXT, IM_END, IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END)
    rows = -(-len(tokenizer) // EMBEDDING_ROW_MULTIPLE) * EMBEDDING_ROW_MULTIPLE
    return qwen3.build_config(preset, {t: tokenizer.convert_tokens_to_ids(t) for t in names}, rows)


def build_model(config, seed: int, dtype: str, init: str = "hf"):
    """Random weights, reproducible for a seed: built on the meta device, then materialised on CPU and
    initialised by transformers' ``initialize_weights`` (which also fills the rotary buffers), or by
    :func:`pool_init` (``init="pool"``)."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    cls = qwen3.model_class() if config.model_type == "qwen3_vl" else Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = cls._from_config(config, dtype=getattr(torch, dtype))
    model.to_empty(device="cpu")
    if init == "pool":
        pool_init(model, seed, float(getattr(config.text_config, "initializer_range", 0.02)))
    else:
        model.initialize_weights()
    model.tie_weights()
    text = config.text_config
    model.generation_config = GenerationConfig(
        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id, do_sample=False
    )
    return model.eval()


def build_image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    """The Qwen2-VL image processor; the defaults keep images at 112 px (bench/bench_learner_op.py asks 1024 px)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, temporal_patch_size=2, merge_size=2
    )


def build_params(preset: str, seed: int, coord_tokens: bool, dtype: str | None, init: str = "hf",
                 family: str = "qwen2.5-vl", vocab: int | None = None, max_pixels: int | None = None) -> dict:
    params = {
        "builder": "tools/make_tiny_model.py",
        "version": BUILDER_VERSION,
        "preset": preset,
        "seed": seed,
        "coord_tokens": coord_tokens,
        "dtype": dtype or family_presets(family)[preset]["dtype"],
    }
    # the defaults leave earlier builds' parameters (and caches) as they were
    params.update({"family": family} if family != "qwen2.5-vl" else {}, **({"init": init} if init != "hf" else {}))
    params.update({"vocab": vocab} if vocab else {}, **({"max_pixels": max_pixels} if max_pixels else {}))
    return params


def _is_built(out: Path, params: dict) -> bool:
    try:
        return json.loads((out / BUILD_FILE).read_text()).get("params") == params
    except (OSError, ValueError):
        return False


def _write(out: Path, params: dict) -> dict:
    family = params.get("family", "qwen2.5-vl")
    tokenizer = build_tokenizer(params["coord_tokens"])
    config = build_family_config(family, params["preset"], tokenizer)
    if params.get("vocab"):  # a real checkpoint's embedding rows (Qwen: 151,936) beyond the tokenizer's ids
        if params["vocab"] < len(tokenizer):
            raise ValueError(f"--vocab {params['vocab']} < the tokenizer's {len(tokenizer)} ids; give at least that")
        config.text_config.vocab_size = params["vocab"]
    model = build_model(config, params["seed"], params["dtype"], params.get("init", "hf"))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    pixels = {"max_pixels": params["max_pixels"]} if params.get("max_pixels") else {}
    image_processor = qwen3.build_image_processor(**pixels) if family == "qwen3-vl" else build_image_processor(**pixels)
    image_processor.save_pretrained(out)  # preprocessor_config.json
    processor_class = qwen3.PROCESSOR_CLASS if family == "qwen3-vl" else "Qwen2_5_VLProcessor"
    # NOTE: written by hand because Qwen2_5_VLProcessor cannot be instantiated without torchvision
    # (its video processor needs it; huggingface/transformers#48558), so processor.save_pretrained is
    # out of reach here. AutoProcessor reads processor_class and loads each part from its own file.
    (out / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}, indent=2) + "\n")
    info = {
        "params": params,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_size": len(tokenizer),
        "embedding_rows": config.text_config.vocab_size,
        "special_token_ids": {t: tokenizer.convert_tokens_to_ids(t) for t in CHAT_SPECIAL_TOKENS},
        "coord_token_ids": (
            [tokenizer.convert_tokens_to_ids(COORD_TOKENS[0]), tokenizer.convert_tokens_to_ids(COORD_TOKENS[-1])]
            if params["coord_tokens"]
            else None
        ),
        "image_processor": {**(qwen3.IMAGE_PROCESSOR_INFO if family == "qwen3-vl" else
                               {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": 14, "merge_size": 2}),
                            **pixels},
    }
    (out / BUILD_FILE).write_text(json.dumps(info, indent=1) + "\n")  # last: marks the build complete
    return info


def ensure_tiny_model(
    path: str | os.PathLike[str] = "artifacts/tiny-model",
    *,
    preset: str = "tiny",
    seed: int = 0,
    coord_tokens: bool = True,
    dtype: str | None = None,
    force: bool = False,
    init: str = "hf",
    family: str = "qwen2.5-vl",
    vocab: int | None = None,
    max_pixels: int | None = None,
) -> Path:
    """The model directory at ``path``, built unless it already holds a build with these parameters.

    Built once and atomically (:func:`common.runs.build_dir.build_once`): concurrent callers never see a
    half-written directory, and a folder that this tool did not write is never deleted.
    """
    presets = family_presets(family)
    if preset not in presets:
        raise ValueError(f"unknown preset {preset!r} for family {family}; choose one of {', '.join(presets)}")
    out = Path(path)
    params = build_params(preset, seed, coord_tokens, dtype, init, family, vocab, max_pixels)
    build_once(out, marker=BUILD_FILE, is_built=lambda d: _is_built(d, params), write=lambda tmp: _write(tmp, params),
               owner="tools/make_tiny_model.py", force=force)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser("python tools/make_tiny_model.py", __doc__)
    parser.add_argument("--out", default="artifacts/tiny-model", help="model directory to write (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    parser.add_argument("--family", choices=FAMILIES, default="qwen2.5-vl", help="architecture (default: %(default)s)")
    parser.add_argument("--preset", default="tiny",
                        help=f"model size (default: %(default)s); qwen2.5-vl: {', '.join(PRESETS)}; "
                             f"qwen3-vl: {', '.join(qwen3.PRESETS)}")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="weight dtype (default: the preset's: float32 for tiny and small, bfloat16 otherwise)")
    parser.add_argument("--no-coord-tokens", action="store_true", help="leave out the 1000 <|coord_k|> tokens")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is up to date")
    parser.add_argument("--init", choices=["hf", "pool"], default="hf",
                        help="hf: transformers' own initialisation (default); pool: slices of one pool of random "
                             "draws, seconds instead of minutes for 7b (memory and speed work, not learning)")
    parser.add_argument("--vocab", type=int, default=None,
                        help="embedding rows (default: the tokenizer's, rounded up; 151936: a real Qwen checkpoint's)")
    parser.add_argument("--max-pixels", type=int, default=None,
                        help=f"the image processor's max_pixels (default: {MAX_PIXELS}; 1048576 keeps 1024-px images)")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        out = ensure_tiny_model(args.out, preset=args.preset, seed=args.seed, coord_tokens=not args.no_coord_tokens,
                                dtype=args.dtype, force=args.force, init=args.init, family=args.family,
                                vocab=args.vocab, max_pixels=args.max_pixels)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    info = json.loads((out / BUILD_FILE).read_text())
    print(f"model: {out} ({args.family}, preset {args.preset}, {info['num_parameters']:,} parameters, tokenizer "
          f"{info['tokenizer_size']}, embedding rows {info['embedding_rows']}, coord ids {info['coord_token_ids']}) "
          f"in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
