"""Checking JSONL records before and while they train: what ``tandem data check|stats`` and the start check run.

    record line ─► JSON ─► load_record (contract, data.coord_mode) ─► images exist, open, match width/height
        ─► (with a processor) prompt + Channel-A answer tokens vs training.global_max_length

:func:`check_file` walks a whole file and returns a :class:`Report` (errors by kind with the first
example and its fix, objects per image, tokens per sample percentiles, what training would drop).
:func:`start_problems` is the launcher's, the learner's and the warm start's fail-fast check of the first
``data.num_records_checked_at_start`` records, without torch or a processor (no token lengths), so it
runs before any training work. :class:`BadRecords` is ``data.on_bad_record`` at run time.

What this module does not know: how records are packed or trained on, or where a run writes.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.data.records import Record, RecordError, load_record
from common.data.jsonl import iter_json_lines

log = logging.getLogger(__name__)

TOO_LONG = "too_long"  # the kind of a record whose prompt + answer exceeds the packing length
MAX_LISTED = 20  # bad records the start check lists one by one (`tandem data check` summarises a whole file)


def error_kind(exc: BaseException) -> str:
    """What a bad record's problem is, without the record: ``objects[].bbox_2d``, ``images[]``, ``coord_mode``."""
    if isinstance(exc, RecordError):
        return re.sub(r"\[\d+\]", "[]", exc.field)
    return type(exc).__name__


def image_root_of(jsonl: str | os.PathLike[str], image_root: str | None) -> str:
    """Where relative image paths resolve: ``data.image_root``, else the JSONL's folder (as the encoder does)."""
    return os.path.abspath(image_root if image_root is not None else Path(jsonl).resolve().parent)


def check_images(record: Record, root: str, where: str, *, open_images: bool = True) -> None:
    """Raise :class:`RecordError` unless every image exists (and, with ``open_images``, opens as an image of the
    record's width x height: the first one; boxes are read against that size)."""
    for i, path in enumerate(record.image_paths(root)):
        if not os.path.isfile(path):
            raise RecordError(where, f"images[{i}]", f"image not found: {path}",
                              f"put the image there, or set data.image_root (relative paths resolve against {root})")
        if not open_images:
            continue
        from PIL import Image  # deferred: the start check of a run without images to open never pays for it

        try:
            with Image.open(path) as im:
                size = im.size
                im.verify()  # reads the file through without decoding the pixels
        except (OSError, SyntaxError, ValueError) as exc:  # PIL raises all three for truncated/corrupt files
            raise RecordError(where, f"images[{i}]", f"cannot be read as an image: {path} ({exc})",
                              "replace the file with a valid image, or drop the record") from None
        if i == 0 and size != (record.width, record.height):
            raise RecordError(where, "width", f"the record says {record.width}x{record.height} but {path} is "
                              f"{size[0]}x{size[1]}", "write the image's own size into width/height (boxes are "
                              "read against it); a converter that resizes images must rescale the boxes too")


def check_line(value: Any, where: str, *, coord_mode: str | None, root: str, open_images: bool = True) -> Record:
    """One decoded line checked against the contract and its images; raises :class:`RecordError`."""
    record = load_record(value, where=where, coord_mode=coord_mode)
    check_images(record, root, where if record.id is None else f"{where} (id {record.id})", open_images=open_images)
    return record


def start_problems(cfg: Any) -> list[str]:
    """Every problem of the first ``data.num_records_checked_at_start`` records of ``data.train_jsonl`` (the
    contract, the coordinate mode, the images), each naming the record and the fix; [] when they are good or
    ``data.on_bad_record`` is skip. Cheap (no processor): the learner runs it before torch is imported."""
    data = cfg.data
    if data.on_bad_record != "fail" or data.num_records_checked_at_start == 0:
        return []
    if not Path(data.train_jsonl).is_file():
        return [f"data.train_jsonl = {data.train_jsonl}: not a file. Fix: point it at a JSONL (docs/data.md)"]
    root = image_root_of(data.train_jsonl, data.image_root)
    problems: list[str] = []
    for n, line in enumerate(iter_json_lines(data.train_jsonl)):
        if n >= data.num_records_checked_at_start:
            break
        try:
            if line.error is not None:
                raise RecordError(line.where, "<line>", line.error, "one JSON object per line")
            check_line(line.value, line.where, coord_mode=data.coord_mode, root=root)
        except RecordError as exc:
            problems.append(str(exc))
    if problems:
        n_bad = len(problems)
        if n_bad > MAX_LISTED:
            problems = [*problems[:MAX_LISTED], f"... and {n_bad - MAX_LISTED} more"]
        problems.append(f"data.on_bad_record = fail: {n_bad} bad records among the first "
                        f"{data.num_records_checked_at_start} of {data.train_jsonl}. Fix: correct them (`tandem data "
                        "check` lists every one in the file), or set data.on_bad_record: skip to train without them")
    return problems


class BadRecords:
    """``data.on_bad_record`` at run time: ``fail`` raises, ``skip`` counts and logs each kind once with its fix.

    Used by the learner's Channel-A and the actors (every record that reaches them is read here).
    """

    def __init__(self, policy: str, source: str) -> None:
        self.policy, self.source = policy, source
        self.by_kind: Counter[str] = Counter()

    def handle(self, exc: BaseException) -> None:
        """Account for one bad record; re-raises under ``fail`` (the message names the record and the fix)."""
        kind = error_kind(exc)
        self.by_kind[kind] += 1
        if self.policy == "fail":
            raise BadRecordError(f"{exc} (data.on_bad_record = fail: set it to skip to train without such records; "
                                 f"`tandem data check {self.source} --config C` lists every bad record)") from exc
        if self.by_kind[kind] == 1:
            log.warning("skipping records of %s with a bad %s (data.on_bad_record = skip; further ones of this kind "
                        "are counted in record_errors, not logged): first: %s", self.source, kind, exc)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())


class BadRecordError(RuntimeError):
    """A bad record met under ``data.on_bad_record: fail``; its cause is the record's own error."""


# --------------------------------------------------------------------------------------------- whole files


@dataclass
class Report:
    """What ``tandem data check|stats`` prints: a file's records, problems and sizes."""

    path: str
    records: int = 0
    good: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # kind -> records
    first_error: dict[str, str] = field(default_factory=dict)  # kind -> the first message (record, field, fix)
    objects: list[int] = field(default_factory=list)  # per good record
    tokens: list[int] = field(default_factory=list)  # prompt + answer per good record (with a processor)
    packing_length: int | None = None
    coord_modes: Counter[str] = field(default_factory=Counter)  # where each record's mode came from

    @property
    def bad(self) -> int:
        return sum(self.errors.values())

    def summary(self) -> str:
        lines = [f"{self.path}: {self.records} records, {self.good} good, {self.bad} bad"]
        if self.coord_modes:
            lines.append("  coordinate mode: " + ", ".join(f"{k} {v}" for k, v in sorted(self.coord_modes.items())))
        if self.objects:
            lines.append(f"  objects per image: {_percentiles(self.objects)}, total {sum(self.objects)}")
        if self.tokens:
            lines.append(f"  tokens per sample (prompt + answer): {_percentiles(self.tokens)}; packing length "
                         f"{self.packing_length}")
        for kind, n in sorted(self.errors.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {n} would be dropped for {kind}; first: {self.first_error[kind]}")
        return "\n".join(lines)


def _percentiles(values: list[int]) -> str:
    s = sorted(values)

    def at(q: float) -> int:
        return s[min(len(s) - 1, round(q * (len(s) - 1)))]

    return f"min {s[0]}, p50 {at(0.5)}, p90 {at(0.9)}, p99 {at(0.99)}, max {s[-1]}"


def check_file(path: str | os.PathLike[str], *, coord_mode: str | None, image_root: str | None = None,
               encoder: Any | None = None, desc_ce_weight: float = 1.0) -> Report:
    """Every record of ``path`` checked; with an ``encoder`` (common/packing/encode.py) also its token length
    (the Channel-A sample the learner would build: prompt with image tokens + canonical-order answer)."""
    from common.detection.answer import canonical_order

    root = image_root_of(path, image_root)
    report = Report(path=os.fspath(path), packing_length=None if encoder is None else encoder.packing_length)

    def bad(kind: str, message: str) -> None:
        report.errors[kind] += 1
        report.first_error.setdefault(kind, message)

    for line in iter_json_lines(path):
        report.records += 1
        if line.error is not None:
            bad("<line>", f"{line.where}: {line.error}; fix: one JSON object per line")
            continue
        try:
            record = check_line(line.value, line.where, coord_mode=coord_mode, root=root)
        except RecordError as exc:
            bad(error_kind(exc), str(exc))
            continue
        own = line.value.get("coord_mode")
        report.coord_modes[f"{own} (record)" if own is not None else f"{coord_mode} (data.coord_mode)"] += 1
        if encoder is not None:
            from common.detection.targets import channel_a_target

            target = channel_a_target(canonical_order(record.objects), encoder.tokenizer,
                                      desc_ce_weight=desc_ce_weight, coord_ids=encoder.coord_ids,
                                      answer_format=encoder.prompts.answer_format)
            try:
                n = int(encoder.prompt(record, record.image_paths(root))["input_ids"].shape[0]) + len(target)
            except (OSError, ValueError) as exc:  # an image PIL opens but the processor cannot take
                bad("processor", f"{line.where}: the processor refused the record ({exc}); fix: re-save the "
                    "image as RGB PNG/JPEG, or drop the record")
                continue
            if n > encoder.packing_length:
                bad(TOO_LONG, f"{line.where}: {n} tokens > packing length {encoder.packing_length}; fix: raise "
                    "training.global_max_length, lower --max-objects, or convert with a smaller --max-side")
                continue
            report.tokens.append(n)
        report.good += 1
        report.objects.append(len(record.objects))
    return report
