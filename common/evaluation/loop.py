"""The evaluation loop shared by ``python -m evaluator`` and the learner (docs/evaluation.md).

    val.jsonl ──load_eval_set (bad lines / missing images skipped, counted)──► records[:max_images]
        │
        ▼ batches of batch_size
    rollout_item (the actor's /infer prompt) ──infer(items, greedy)──► (ver per output, outputs)
        │   waits: whatever ``infer`` waits for (HttpInfer: the HTTP timeout); items a sync fence
        │   aborted are resubmitted up to max_abort_retries times, then count as parse failures
        ▼
    parse_rollout (strict) ──► object_scores (coord logprobs | 1.0) ──► ImageResult
        ▼
    evaluate_detections ──► EvalResult: report, per-image predictions, ver min/max, elapsed

``infer`` is any callable ``infer(items: list[InferItem], sampling: SamplingParams) ->
(vers: list[int], outputs: list[InferOutput-like])`` with ``vers`` one per output (or a single
``[ver]`` for the whole batch); outputs need ``token_ids``, ``finish_reason`` and optionally
``logprobs`` (parallel to ``token_ids``). :class:`HttpInfer` is one over plain HTTP; a process with
its own client (the learner) wraps that instead.

What this module does not know: torch, models, where the server runs. The tokenizer is passed in.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from common.detection.answer import DEFAULT_PROMPTS, Prompts, build_messages
from common.data.records import Record, RecordError, load_record
from common.evaluation.metrics import DetectionReport, ImageResult, evaluate_detections, object_scores
from common.data.jsonl import iter_json_lines
from common.evaluation.lvis import Federated, federated_of
from common.detection.parsing import parse_rollout
from common.wire.http import HealthResponse, InferItem, InferRequest, InferResponse, SamplingParams

log = logging.getLogger(__name__)

InferFn = Callable[[list[InferItem], SamplingParams], tuple[Sequence[int], Sequence[Any]]]

#: Whether this protocol version can ask the engine for per-token logprobs (added in parallel).
PROTOCOL_HAS_LOGPROBS = "logprobs" in SamplingParams.model_fields


def greedy_sampling(max_new_tokens: int) -> SamplingParams:
    """Greedy, seeded decoding; per-token logprobs requested when the protocol has the field."""
    extra = {"logprobs": True} if PROTOCOL_HAS_LOGPROBS else {}
    return SamplingParams(temperature=0.0, max_tokens=max_new_tokens, seed=0, **extra)


def rollout_item(record: Record, image_paths: Sequence[str], *, item_id: str | None = None,
                 prompts: Prompts = DEFAULT_PROMPTS) -> InferItem:
    """The ``/infer`` item for ``record``: the training prompt with images as slots, paths in order.

    ``common/packing/encode.py:Encoder.prompt_for_rollout`` delegates here, so Channel-B and evaluation send one form.
    """
    messages, images = [], []
    for m in build_messages(record, list(image_paths), prompts=prompts):
        parts = []
        for part in m["content"]:
            if part["type"] == "image":
                images.append(part["image"])
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part["text"]})
        messages.append({"role": m["role"], "content": parts})
    return InferItem(id=item_id, messages=messages, images=images or None)


@dataclass
class EvalSet:
    """Records read from one JSONL, the root their relative image paths resolve against, what was skipped."""

    path: str
    image_root: str  # absolute
    records: list[Record]
    skipped: list[str] = field(default_factory=list)  # "val.jsonl:7: <problem>", one per skipped line
    federated: list[Federated | None] = field(default_factory=list)  # per record: its LVIS labels (lvis_eval.py)


def load_eval_set(path: str | os.PathLike[str], *, max_images: int | None = None, image_root: str | None = None,
                  coord_mode: str | None = None) -> EvalSet:
    """The first ``max_images`` valid records of ``path`` (all if None), in file order.

    A line that is not JSON, breaks the data contract, or names an image file that does not exist is
    skipped and listed in ``EvalSet.skipped`` (file:line and the problem), never fatal.
    ``image_root`` None = the JSONL's folder (as ``data.image_root`` does); ``coord_mode`` is
    ``data.coord_mode`` (None = each record must carry its own).
    """
    path = os.fspath(path)
    root = os.path.abspath(image_root if image_root is not None else Path(path).resolve().parent)
    name = Path(path).name
    out = EvalSet(path=path, image_root=root, records=[])
    for line in iter_json_lines(path):
        if max_images is not None and len(out.records) >= max_images:
            break
        if line.error is not None:
            out.skipped.append(f"{line.where}: {line.error}")
            continue
        try:
            rec = load_record(line.value, where=line.where, coord_mode=coord_mode)
            fed = federated_of(line.value)
        except RecordError as exc:
            out.skipped.append(str(exc))
            continue
        except ValueError as exc:  # neg_categories / not_exhaustive_categories malformed
            out.skipped.append(f"{line.where}: {exc}")
            continue
        missing = [p for p in rec.image_paths(root) if not os.path.isfile(p)]
        if missing:
            out.skipped.append(f"{line.where}: image not found: {missing[0]} (relative paths resolve against {root})")
            continue
        out.records.append(rec)
        out.federated.append(fed)
    for s in out.skipped[:5]:
        log.warning("skipped %s", s)
    if len(out.skipped) > 5:
        log.warning("skipped %d more lines of %s", len(out.skipped) - 5, name)
    return out


@dataclass
class EvalResult:
    """One evaluation: the report, per-image predictions, the weight versions used, the wall time."""

    report: DetectionReport
    images: list[ImageResult]  # in record order, with paths, response text and ver
    ver_min: int | None  # lowest/highest ver of the /infer responses (differ only across a weight sync)
    ver_max: int | None
    elapsed_s: float
    sampling: dict[str, Any]

    def record(self) -> dict[str, Any]:
        """Flat ``eval/*`` keys for a metrics record; None values omitted; ``eval/ver_min`` only if ≠ ver."""
        r = self.report
        values = {
            "eval/precision": r.precision, "eval/recall": r.recall, "eval/f1": r.f1, "eval/map": r.map,
            "eval/map_50": r.map_50, "eval/map_per_class": r.map_per_class, "eval/map_50_per_class": r.map_50_per_class,
            "eval/lvis_map": r.lvis_map, "eval/lvis_map_50": r.lvis_map_50,
            "eval/parse_failure_rate": r.parse_failure_rate,
            "eval/truncated_rate": r.truncated_rate, "eval/objects_per_image": r.objects_per_image,
            "eval/gt_per_image": r.gt_per_image, "eval/n_images": r.n_images,
            "eval/mean_matched_iou": r.mean_matched_iou, "eval/ver": self.ver_max, "eval/time_s": self.elapsed_s,
            "eval/score_source": r.score_source,
            "eval/ver_min": self.ver_min if self.ver_min != self.ver_max else None,
            "eval/f1_ci_low": r.f1_ci_low, "eval/f1_ci_high": r.f1_ci_high, "eval/duplicate_rate": r.duplicate_rate,
            **{f"eval/f1_gt_{name}": b["f1"] for name, b in r.by_gt_count.items()},
            # per-image counts ride with the record so the summary can bootstrap first vs last
            # (common/evaluation/stats.py)
            "eval/image_counts": r.image_counts.as_dict() if r.image_counts is not None else None,
        }
        return {k: v for k, v in values.items() if v is not None}

    def as_dict(self) -> dict[str, Any]:
        return {"report": self.report.as_dict(), "ver_min": self.ver_min, "ver_max": self.ver_max,
                "elapsed_s": self.elapsed_s, "sampling": self.sampling,
                "images": [im.as_dict() for im in self.images]}


def _vers_for(vers: Sequence[int], n: int) -> list[int]:
    vers = [int(v) for v in vers]
    if len(vers) == 1 and n != 1:
        return vers * n
    if len(vers) != n:
        raise RuntimeError(f"infer returned {len(vers)} vers for {n} outputs (give one per output, or one per batch)")
    return vers


def evaluate_records(records: Sequence[Record], infer: InferFn, *, tokenizer: Any, coord_ids: Sequence[int] | None,
                     image_root: str | os.PathLike[str], max_new_tokens: int, batch_size: int = 8,
                     max_abort_retries: int = 2, prompts: Prompts = DEFAULT_PROMPTS,
                     federated: Sequence[Federated | None] | None = None) -> EvalResult:
    """Greedy rollouts of ``records`` through ``infer``, parsed strictly and scored (module docstring).

    ``coord_ids``: the 1000 coord token ids (``common.detection.coord_tokens.coord_token_ids``; None = look them up).
    ``prompts``: the run's ``data.system_prompt`` / ``data.user_prompt`` (the model's training prompt).
    ``federated``: ``EvalSet.federated`` (parallel to ``records``): LVIS records add the federated AP.
    Raises ValueError for no records; whatever ``infer`` raises propagates.
    """
    if not records:
        raise ValueError("empty eval set: no records to evaluate")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sampling = greedy_sampling(max_new_tokens)
    t0 = time.monotonic()
    paths = [[os.path.abspath(p) for p in r.image_paths(image_root)] for r in records]
    outputs: list[Any] = [None] * len(records)
    vers: list[int | None] = [None] * len(records)
    aborted: set[int] = set()
    for start in range(0, len(records), batch_size):
        pending = list(range(start, min(len(records), start + batch_size)))
        for attempt in range(max_abort_retries + 1):
            items = [rollout_item(records[i], paths[i], item_id=records[i].id or f"eval-{i}", prompts=prompts) for i in pending]
            got_vers, got = infer(items, sampling)
            if len(got) != len(items):
                raise RuntimeError(f"infer returned {len(got)} outputs for {len(items)} items")
            for i, v, o in zip(pending, _vers_for(got_vers, len(got)), got):
                outputs[i], vers[i] = o, v
            pending = [i for i in pending if outputs[i].finish_reason == "abort"]
            if not pending:
                break
            log.info("%d eval rollouts aborted by a sync fence (try %d); resubmitting", len(pending), attempt + 1)
        aborted.update(pending)
        log.info("eval: %d/%d images rolled out (%.1f s)", min(len(records), start + batch_size), len(records),
                 time.monotonic() - t0)

    with_logprobs = all(getattr(o, "logprobs", None) is not None for o in outputs)
    images = []
    for i, (rec, out) in enumerate(zip(records, outputs)):
        ids = [] if i in aborted else out.token_ids  # aborted tokens are unusable: a failed rollout
        parse = parse_rollout(ids, tokenizer, coord_ids=coord_ids, answer_format=prompts.answer_format)
        scores = object_scores(parse, out.logprobs if with_logprobs and i not in aborted else None)
        images.append(ImageResult.from_parse(rec, parse, scores, finish_reason=out.finish_reason, images=paths[i],
                                             ver=vers[i]))
    report = evaluate_detections(images, score_source="coord_logprob" if with_logprobs else "constant",
                                 federated=federated)
    if aborted:
        report.notes.append(f"{len(aborted)} rollouts stayed aborted by sync fences after {max_abort_retries} "
                            "resubmissions; counted as parse failures")
    known = [v for v in vers if v is not None]
    return EvalResult(report=report, images=images, ver_min=min(known, default=None), ver_max=max(known, default=None),
                      elapsed_s=time.monotonic() - t0, sampling=sampling.model_dump())


class InferError(RuntimeError):
    """An /infer call that failed (after one retry for transport errors and 5xx)."""


class HttpInfer:
    """An ``InferFn`` over one rollout server's HTTP API: plain httpx and the ``common.wire.http`` models.

    Deadlines: ``connect_timeout_s`` to connect, ``timeout_s`` for a whole batch to come back (not
    retried). A dropped connection or 5xx is retried once after 1 s; a 4xx raises at once with the
    server's message.
    """

    def __init__(self, url: str, *, timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 client_id: str = "evaluator", start_hint: str | None = None, min_ver: int | None = None) -> None:
        """``min_ver``: every batch is admitted only once the server holds weights of at least this ver
        (``InferRequest.min_ver``; the learner's evaluation asks for the ver it just pushed)."""
        self.url = url.rstrip("/")
        self.min_ver = min_ver
        self.client_id = client_id
        self.start_hint = start_hint or "python -m rollout_server --config CONFIG"
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))

    def close(self) -> None:
        self._http.close()

    def health(self, timeout_s: float = 5.0) -> tuple[int, HealthResponse]:
        r = self._http.get("/health", timeout=timeout_s)
        return r.status_code, HealthResponse.model_validate_json(r.content)

    def wait_healthy(self, deadline_s: float, *, alive: Callable[[], str | None] | None = None,
                     poll_s: float = 0.25) -> HealthResponse:
        """Poll ``GET /health`` until 200. ``alive()`` returns why the server is gone (then we stop at once).

        Raises TimeoutError naming the URL, the deadline, the last answer and the start command.
        """
        end, last = time.monotonic() + deadline_s, "no answer yet"
        while True:
            if alive is not None and (gone := alive()):
                raise RuntimeError(f"rollout server for {self.url} {gone}")
            try:
                code, h = self.health(timeout_s=max(0.1, min(5.0, end - time.monotonic())))
                if code == 200:
                    return h
                last = f"HTTP {code}, status {h.status}"
            except (httpx.HTTPError, ValidationError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= end:
                raise TimeoutError(f"rollout server at {self.url} not healthy (GET /health 200) after {deadline_s:g} s;"
                                   f" last answer: {last}. Start it with `{self.start_hint}`, or allow it longer")
            time.sleep(poll_s)

    def __call__(self, items: list[InferItem], sampling: SamplingParams) -> tuple[list[int], list[Any]]:
        body = InferRequest(items=items, sampling=sampling, client=self.client_id,
                            min_ver=self.min_ver).model_dump_json(exclude_none=True)
        problem = ""
        for attempt in range(2):
            if attempt:
                time.sleep(1.0)
            try:
                r = self._http.post("/infer", content=body, headers={"Content-Type": "application/json"})
            except httpx.TimeoutException:
                problem = f"no answer within {self.timeout_s:.0f} s"
                break  # a slow server would be slow again
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
                continue
            if r.status_code == 200:
                resp = InferResponse.model_validate_json(r.content)
                return [resp.ver] * len(resp.outputs), list(resp.outputs)
            problem = f"HTTP {r.status_code}: {r.text[:500]}"
            if r.status_code < 500:
                break
        raise InferError(f"POST {self.url}/infer ({len(items)} items) failed: {problem}. Is the server running "
                         f"(`{self.start_hint}`)?")
