"""The ``data`` config section: the training and validation records, their prompts and coordinate mode, and
what a bad record does (the record contract: docs/data.md; the checks: common/dataset/check.py).

Split from ``common/config_schema.py``, which re-exports :class:`DataConfig`.

What this module does not know: how records are read or trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.config_fields import doc


@dataclass
class DataConfig:
    """Training data in the JSONL contract of docs/data.md."""

    train_jsonl: str = doc("Training records (JSONL).")
    val_jsonl: str | None = doc("Validation records (JSONL); None = no evaluation.", None)
    image_root: str | None = doc("Directory relative image paths resolve against; None = the JSONL's directory.", None)
    system_prompt: str | None = doc(
        "System text of every training, rollout and evaluation prompt; None = the built-in detector instructions "
        "(common/assistant_json.py). Use the prompt your Stage-1 checkpoint was trained with.", None
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
        "built-in instructions describe it (common/assistant_json.py). docs/models.md.", "object_keys")
    on_bad_record: Literal["fail", "skip"] = doc(
        "A record that breaks the contract (docs/data.md) or whose image is missing. fail: the first "
        "num_records_checked_at_start records of train_jsonl are checked before any training work and one bad "
        "record stops the start (exit 2, every problem listed; the launcher, the learner and the warm start check); "
        "later ones stop the run. skip: counted (packing/channel_a_dropped_total, actor/bad_records) and logged once "
        "per kind with the fix. `tandem data check` checks a whole file.", "fail")
    num_records_checked_at_start: int = doc(
        "Records of train_jsonl (from the top) checked at start under on_bad_record: fail: the contract, the "
        "coordinate mode, that the images exist, open and have the record's width x height. 0 = none.", 1000)
