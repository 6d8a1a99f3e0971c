"""Channel-A encoding: one record line → a Segment, in this process or in ``data.encode_workers`` worker processes.

::

    record line ─► JSON ─► load_record ─► images exist ─► channel_a_target ─► Encoder.encode
        ─► Encoded (segment | None, error, too_long)

:func:`encode_line` is the one home of that logic: :class:`learner.data.ChannelAData` calls it in-process
(``data.encode_workers: 0``) and the workers of :class:`EncodePool` call it with their own Encoder. It never
counts or raises for a bad record itself: a ValueError from the record (RecordError / TargetError /
JSONDecodeError) comes back in ``Encoded.error``, and the caller applies ``data.on_bad_record`` when it
*consumes* the sample, so a lookahead of encoded samples changes neither the order of errors nor the counters.
Any other exception (an unreadable image, a processor failure) propagates: raised by ``Future.result()`` in the
parent, again when that sample is consumed.

:class:`EncodePool` is a ``ProcessPoolExecutor`` (spawn: no fork of a process holding CUDA, threads or a
process group) whose workers each build the Encoder once in the initializer
(:func:`common.packing.encode.encoder_from_config`; the config pickles), run torch on one thread (the
DataLoader workers' rule), and log warnings to stderr. Workers start when the pool is made, so
their start-up (torch, transformers and the processor: a few seconds) overlaps the caller's own.

What this module does not know: sampler order, windows, packing or checkpoints (learner/data.py).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import pickle
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

from common.data.check import check_images
from common.data.records import load_record
from common.detection.answer import canonical_order
from common.detection.targets import channel_a_target
from common.packing.segment import Segment

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0  # EncodePool.close(): how long workers may take to finish their sample and exit
RESULT_TIMEOUT_S = 300.0  # EncodePool.result(): one sample (a few ms; a worker's start-up a few s) waited for at most


class Encoded(NamedTuple):
    """One sample's encoding: the segment (None: too long or a bad record), the bad record's error, and how many
    samples the Encoder dropped as longer than ``packing_length`` (0 or 1)."""

    segment: Segment | None
    error: ValueError | None
    too_long: int


def encode_line(cfg: Any, encoder: Any, source: str, line_text: str, epoch: int, line: int, ver: int) -> Encoded:
    """Line ``line`` (0-based) of ``source`` drawn in ``epoch``, as a Channel-A segment tagged ``ver`` with sample id
    ``A:<record id or line>@<epoch>``. A record that breaks the contract returns its error instead of raising."""
    where = f"{source}:{line + 1}"
    try:
        raw = json.loads(line_text)
        record = load_record(raw, where=where, coord_mode=cfg.data.coord_mode)
        # existence only: opening every image twice per draw would double the decode cost
        check_images(record, encoder.image_root or ".", where, open_images=False)
        target = channel_a_target(
            canonical_order(record.objects), encoder.tokenizer,
            desc_ce_weight=cfg.stage2_ab.desc_ce_weight, coord_ids=encoder.coord_ids,
            answer_format=encoder.prompts.answer_format,
        )
    except ValueError as exc:  # RecordError / TargetError / JSONDecodeError
        return Encoded(None, exc, 0)
    sample_id = f"A:{record.id if record.id is not None else line}@{epoch}"
    before = encoder.counters["too_long_dropped"]
    segment = encoder.encode(record, target, sample_id=sample_id, channel="A", ver=ver)
    return Encoded(segment, None, encoder.counters["too_long_dropped"] - before)


# -- worker side -----------------------------------------------------------------------------------

_worker: dict[str, Any] = {}  # this worker process's cfg and Encoder (set by _init_worker)


def _init_worker(cfg: Any, log_level: int) -> None:
    import torch

    from common.packing.encode import encoder_from_config

    torch.set_num_threads(1)  # N workers on N cores; the rope index's tiny ops gain nothing from more
    # warnings and errors only (a too-long sample, a processor's complaint): the parent already logged the start-up
    logging.basicConfig(level=max(log_level, logging.WARNING),
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    _worker.update(cfg=cfg, encoder=encoder_from_config(cfg))


def _ready() -> bool:
    return "encoder" in _worker


def _encode_in_worker(source: str, line_text: str, epoch: int, line: int, ver: int) -> Encoded:
    try:
        out = encode_line(_worker["cfg"], _worker["encoder"], source, line_text, epoch, line, ver)
    except Exception as exc:  # raised in the parent by Future.result(); one that would not unpickle there breaks the pool
        if isinstance(portable(exc), _Rebuilt):
            raise RuntimeError(f"{source}:{line + 1}: {type(exc).__name__}: {exc}") from None
        raise
    return out if out.error is None else out._replace(error=portable(out.error))


def portable(exc: BaseException) -> BaseException:
    """``exc`` as it can travel back to the parent: itself when it pickles, else a copy of its class, args and
    attributes (RecordError's four-argument ``__init__`` does not survive pickling)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return _Rebuilt(type(exc), exc.args, dict(vars(exc)))  # type: ignore[return-value]


class _Rebuilt:
    """Pickles as the exception it describes, rebuilt without calling its ``__init__``."""

    def __init__(self, cls: type, args: tuple, attrs: dict[str, Any]) -> None:
        self.cls, self.args, self.attrs = cls, args, attrs

    def __reduce__(self) -> Any:
        return _rebuild, (self.cls, self.args, self.attrs)


def _rebuild(cls: type, args: tuple, attrs: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(attrs)
    return exc


# -- parent side -----------------------------------------------------------------------------------


def running(proc: multiprocessing.process.BaseProcess) -> bool:
    """Whether ``proc`` has not exited, by its sentinel (readable once it exits). Not ``proc.is_alive()``: once
    another thread has reaped the child (the executor's manager thread joins its workers too), ``is_alive()``
    keeps answering True (waitpid fails with ECHILD, so no exit code is ever recorded)."""
    from multiprocessing.connection import wait

    return proc.exitcode is None and not wait([proc.sentinel], 0)


class EncodePool:
    """``workers`` spawned processes encoding Channel-A lines of ``cfg.data.train_jsonl`` with :func:`encode_line`.

    :meth:`submit` returns a Future of :class:`Encoded`. Submit and consume from one thread (the Channel-A
    prefetch thread in the learner); :meth:`close` from any, once that thread is done with it.
    """

    def __init__(self, cfg: Any, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"EncodePool needs at least one worker, got {workers} (data.encode_workers)")
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
            initargs=(cfg, logging.getLogger().getEffectiveLevel()),
        )
        for _ in range(workers):  # start every worker now: their start-up overlaps the caller's
            self._pool.submit(_ready)

    def submit(self, source: str, line_text: str, epoch: int, line: int, ver: int) -> Future:
        if self._pool is None:
            raise RuntimeError("the Channel-A encode pool is closed")
        return self._pool.submit(_encode_in_worker, source, line_text, epoch, line, ver)

    def result(self, future: Future, where: str, timeout_s: float = RESULT_TIMEOUT_S) -> Encoded:
        """The future's Encoded; a dead worker is reported as such (naming the sample and the key), and one that has
        not answered within ``timeout_s`` as a TimeoutError naming what was awaited."""
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout as exc:
            raise TimeoutError(
                f"no Channel-A encode worker returned {where} within {timeout_s:.0f}s (data.encode_workers = "
                f"{self.workers}): a worker is stuck (an image read on a hung filesystem?) or every one is busy far "
                "longer than a sample takes. Fix: check the image path's storage, or set data.encode_workers: 0 to "
                "encode in this process and see where it blocks") from exc
        except BrokenProcessPool as exc:
            raise RuntimeError(
                f"a Channel-A encode worker died while encoding {where} (data.encode_workers = {self.workers}); "
                "its own error, if any, is in this process's stderr above. Likely causes: out of memory (each "
                "worker holds a processor and its samples) or model.path's processor failing to load. Fix: "
                "lower data.encode_workers, or set it to 0 to encode in this process and see the error here"
            ) from exc

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Cancel what has not started and let the workers finish the sample in hand and exit; one still alive after
        ``timeout_s`` (stuck on an image read) is terminated. Safe to call twice."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        processes = list((pool._processes or {}).values())  # shutdown(wait=False) forgets them
        pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout_s
        for proc in processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        if stuck := [proc for proc in processes if running(proc)]:
            log.error("%d Channel-A encode worker(s) did not exit within %.0fs of close (pids %s); terminating them",
                      len(stuck), timeout_s, [proc.pid for proc in stuck])
            for proc in stuck:
                proc.terminate()
            for proc in stuck:  # so that no worker outlives close(): SIGTERM, then SIGKILL
                proc.join(5.0)
                if running(proc):
                    proc.kill()
                    proc.join(5.0)
