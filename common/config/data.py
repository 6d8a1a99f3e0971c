"""The ``data`` config section: the training and validation records, their prompts, coordinate mode and image
size, and what a bad record does (the record contract: docs/data.md; the checks: common/data/check.py).

:class:`Config` (``common/config/schema.py``) holds it as ``data``.

:func:`check_data_rules` holds the section's cross-field rules (the image size: common/data/image_size.py), called by
:func:`common.config.load._check_rules` with its problem list.

What this module does not know: how records are read or trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from common.data import image_size
from common.config.fields import doc


@dataclass
class DataConfig:
    """Training data in the JSONL contract of docs/data.md."""

    train_jsonl: str = doc("Training records (JSONL).")
    val_jsonl: str | None = doc("Validation records (JSONL); None = no evaluation.", None)
    image_root: str | None = doc("Directory relative image paths resolve against; None = the JSONL's directory.", None)
    system_prompt: str | None = doc(
        "System text of every training, rollout and evaluation prompt; None = the built-in detector instructions "
        "(common/detection/answer.py). Use the prompt your Stage-1 checkpoint was trained with.", None
    )
    user_prompt: str | None = doc("User text after the images; None = the built-in request.", None)
    coord_mode: Literal["pixel", "norm1000"] | None = doc(
        "How the boxes of records without their own coord_mode are read: pixel (numbers in [0, W] x [0, H], "
        "divided by the record's width/height) or norm1000 (bins 0..999, kept as they are; the origin's records). "
        "None = every record must carry coord_mode. A record whose own coord_mode disagrees is an error, never a "
        "rescale (docs/data.md).", None)
    answer_format: Literal["object_keys", "objects_array"] = doc(
        "The assistant JSON the model is trained to write and its answers are parsed in (strictly: the other format "
        "parses as invalid). object_keys: {\"object_1\": {\"desc\": ..., \"bbox_2d\": [4 coord tokens]}, ...} (the "
        "origin's Stage-1 format); objects_array: {\"objects\": [{\"desc\": ..., \"bbox_2d\": [...]}, ...]} (the "
        "origin's later format). Use the format your Stage-1 checkpoint answers in; with system_prompt None the "
        "built-in instructions describe it (common/detection/answer.py). docs/models.md.", "object_keys")
    on_bad_record: Literal["fail", "skip"] = doc(
        "A record that breaks the contract (docs/data.md) or whose image is missing. fail: the first "
        "num_records_checked_at_start records of train_jsonl are checked before any training work and one bad "
        "record stops the start (exit 2, every problem listed; the launcher, the learner and the warm start check); "
        "later ones stop the run. skip: counted (packing/channel_a_dropped_total, actor/bad_records) and logged once "
        "per kind with the fix. `tandem data check` checks a whole file.", "fail")
    num_records_checked_at_start: int = doc(
        "Records of train_jsonl (from the top) checked at start under on_bad_record: fail: the contract, the "
        "coordinate mode, that the images exist, open and have the record's width x height. 0 = none.", 1000)
    encode_workers: int = doc(
        "Worker processes that encode Channel-A samples (JSON record, target, processor, tokenizer, rope index) "
        "ahead of the window that takes them, like DataLoader workers: each learner rank (and the warm start) "
        "starts its own (spawn); each worker loads model.path's processor and tokenizer once (memory and a few "
        "seconds of start-up per worker, no weights) and uses a CPU core. 0 = encode in the process that builds "
        "the window; windows, resume and bad-record handling are the same either way. A few per rank help when "
        "building a window takes longer than the step trains (small models, large or crowded images).", 0)
    min_pixels: int | None = doc(
        "Smallest image area (width × height, pixels) an image is resized up to, aspect ratio kept. Applied alike by "
        "the learner's and the actors' encoder, the rollout server (hf engine: the same processor; vllm: "
        "mm_processor_kwargs) and so the evaluator. None = the model's own (preprocessor_config.json). docs/data.md, "
        "Image size.", None)
    max_pixels: int | None = doc(
        "Largest image area (width × height, pixels) an image is resized down to, aspect ratio kept, sides a "
        "multiple of patch_size × merge_size (28 for Qwen2/2.5-VL, 32 for Qwen3-VL): at most max_pixels / 28² "
        "(/ 32²) image tokens an image, e.g. 1003520 = 1280 tokens at 28. At least one merged patch (28² = 784, "
        "32² = 1024) and ≥ min_pixels. Applied where min_pixels is; a server that resizes otherwise is refused at "
        "the actors' and the evaluator's start. None = the model's own. docs/data.md, Image size.", None)


def check_data_rules(cfg: Any, problems: Any) -> None:
    """``data.encode_workers`` ≥ 0; ``data.min_pixels`` / ``data.max_pixels``: positive, min ≤ max and, where
    ``model.path`` holds a preprocessor_config.json, at least one merged patch and in range with the model's value
    for the unset key."""
    d = cfg.data
    if isinstance(d.encode_workers, int) and d.encode_workers < 0:
        problems.add("data.encode_workers", d.encode_workers, "must be ≥ 0",
                     "use 0 to encode Channel-A samples in the learner process, or a number of worker processes "
                     "such as 2")
    lo = d.min_pixels if isinstance(d.min_pixels, int) else None
    hi = d.max_pixels if isinstance(d.max_pixels, int) else None
    if lo is None and hi is None:
        return
    path = cfg.model.path if isinstance(cfg.model.path, str) else ""
    model = image_size.model_pixels(path) if path else None
    for key, value, problem, fix in image_size.problems(lo, hi, model, path):
        problems.add(key, value, problem, fix)
