"""ZMQ codecs: the pack message (actor -> learner rank r) and the credits message (back-channel).

Re-exported by :mod:`common.wire.http`, which is where readers look for the wire contract; this
module holds the byte-level codecs so that ``protocol.py`` stays a readable list of messages.

Pack message, one ZMQ multipart message per pack::

    frame 0      msgpack map (the header, keys below, exactly these)
    frame 1..N   raw little-endian C-contiguous array bytes, one frame per entry of header["tensors"]

    header = {
        "schema":     int,    SCHEMA_VERSION of the sender; any other value is rejected
        "ver":        int,    server weight version every segment of the pack was generated under
        "actor":      str,    sender id, e.g. "actor-r0-0"
        "seq":        int,    per-actor message counter from 0 (gaps = messages lost on the way); a
                              restarted actor continues its id's count (actor/learner_link.py, "Rejoin")
        "created_at": float,  sender wall clock, seconds since the epoch (time.time())
        "n_segments": int,    segments in the pack
        "n_tokens":   int,    T, tokens in the pack
        "channel":    str,    "A" (ground-truth targets) or "B" (matched rollout targets)
        "tensors":    [{"name": str, "dtype": str, "shape": [int, ...]}, ...]   one per buffer frame
        "meta":       map,    msgpack-safe sender data; a Pack adds meta["segments"] = Pack.segment_meta()
    }

    Example header (one pack of two image-less segments):
        {"schema": 2, "ver": 12, "actor": "actor-r0-0", "seq": 41, "created_at": 1718000000.25,
         "n_segments": 2, "n_tokens": 1012, "channel": "B",
         "tensors": [{"name": "input_ids", "dtype": "int64", "shape": [1012]}, ...,
                     {"name": "cu_seqlens", "dtype": "int32", "shape": [3]}, ...],
         "meta": {"segments": [{"sample_id": "coco-17", "length": 612, "n_coord": 8, "n_images": 0,
                                "patches": 0, "meta": {}}, {...}], "rollout/f1": 0.71}}

Neither side copies array bytes: ``encode_pack_message`` hands ZMQ memoryviews of the arrays
(``send_multipart(frames, copy=False)``) and ``decode_pack_message`` returns read-only numpy views
of the received frames (``recv_multipart(copy=False)``).

Credits message, one single-frame msgpack map per update (learner rank r -> its actors)::

    {"schema", "rank", "ver_current", "depth", "target", "version_window", "received_total", "ts", "actors"}
    + optional "done": true   only in the rank's last message, sent as it shuts down (its actors exit)

Optional keys are how a message grows without a schema bump: a receiver accepts a message with or
without them (absent = the field's default), and a sender writes one only when it differs from that
default, so an ordinary message stays byte-identical to what older receivers expect. An older actor
that receives a ``done`` message counts it as invalid and falls back to its silence deadline.

Decoding never raises anything but :class:`ProtocolError`: a receiver catches that one type, counts
the message as dropped, and keeps going. What this module does not know: sockets, packing policy,
or what the learner does with a pack.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from common.packing.segment import Pack, SegmentError

#: Version of every message in :mod:`common.wire.http`; bump on any incompatible change.
#: 2: packs carry pixel_values as uint8 plus pixel_affine (common.packing.segment), not float32.
SCHEMA_VERSION = 2

#: The only dtypes a buffer frame may carry (wire name -> little-endian numpy dtype).
WIRE_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(code)
    for name, code in {
        "int64": "<i8",
        "int32": "<i4",
        "float32": "<f4",
        "float16": "<f2",
        "uint8": "u1",
        "bool": "?",
    }.items()
}

PACK_HEADER_KEYS = frozenset(
    {"schema", "ver", "actor", "seq", "created_at", "n_segments", "n_tokens", "channel", "tensors", "meta"}
)
CREDITS_KEYS = frozenset(
    {"schema", "rank", "ver_current", "depth", "target", "version_window", "received_total", "ts", "actors"}
)
#: Keys added after schema 1 went out: a message may omit them (see the module docstring).
CREDITS_OPTIONAL_KEYS = frozenset({"done"})
_TENSOR_KEYS = frozenset({"name", "dtype", "shape"})


class ProtocolError(ValueError):
    """A message that crossed a process boundary does not match the contract; the text says how."""


@dataclass
class PackMessage:
    """A decoded pack message: the header fields plus named arrays that view the received frames."""

    schema: int  # SCHEMA_VERSION (anything else was rejected)
    ver: int  # weight version of every segment in the pack
    actor: str  # sender id
    seq: int  # per-actor message counter from 0
    created_at: float  # sender wall clock, seconds since the epoch
    n_segments: int  # segments in the pack (0 for a bare encode_pack_message)
    n_tokens: int  # T, tokens in the pack
    channel: str  # "A" or "B"
    tensors: dict[str, np.ndarray]  # read-only views of the frames, in header order; may be unaligned
    meta: dict[str, Any] = field(default_factory=dict)  # sender data; "segments" for a Pack


@dataclass(frozen=True)
class Credits:
    """What learner rank ``rank`` tells its actors so they stop producing work that would arrive stale.

    Example: ``Credits(schema=2, rank=0, ver_current=12, depth=3, target=8, version_window=2,
    received_total=1040, ts=1718000000.5, actors={"actor-r0-0": [41, 2], "actor-r0-1": [17, 1]})``
    — actor-r0-0, having sent seq 0..43, has 2 packs in flight (42, 43) and 2 queued; packs of
    ``ver < 10`` would be dropped as stale on arrival.
    """

    schema: int
    rank: int  # learner rank that sent this
    ver_current: int  # the learner's current weight version (last completed sync)
    depth: int  # eligible packs waiting in this rank's ready queue right now
    target: int  # prefetch_target_packs: actors keep in-flight + queued <= target
    version_window: int  # packs with ver < ver_current - version_window are dropped as stale
    received_total: int  # pack messages this rank has received since start (all actors)
    ts: float  # sender wall clock, seconds since the epoch
    #: per actor id: [last seq received from it, its packs still in the ready queue]; actors this
    #: rank has not heard from yet are absent
    actors: dict[str, list[int]] = field(default_factory=dict)
    #: True only in the last message of a rank that finished training and is closing its sockets:
    #: its actors stop at once (exit 0) instead of waiting out ``actor.learner_silence_s`` +
    #: ``actor.learner_wait_timeout_s``. Optional on the wire (absent = False).
    done: bool = False


# ---------------------------------------------------------------------------------------------
# actor -> learner rank r (ZMQ): the pack message
# ---------------------------------------------------------------------------------------------


def encode_pack_message(
    *,
    ver: int,
    actor: str,
    seq: int,
    channel: str,
    n_segments: int,
    n_tokens: int,
    tensors: Mapping[str, np.ndarray],
    meta: Mapping[str, Any] | None = None,
    created_at: float | None = None,
) -> list[bytes | memoryview]:
    """Frames for ``socket.send_multipart(frames, copy=False)``; array bytes are not copied.

    Arrays already C-contiguous, little-endian and of a :data:`WIRE_DTYPES` dtype are passed as
    memoryviews; anything else is converted first (that one copies). The caller must not mutate
    the arrays until ZMQ has sent them.
    """
    specs, buffers = [], []
    for name, array in tensors.items():
        array = np.asarray(array)
        wire_name = array.dtype.name
        if wire_name not in WIRE_DTYPES:
            raise ProtocolError(f"tensor {name!r}: dtype {array.dtype} is not one of {sorted(WIRE_DTYPES)}")
        array = np.ascontiguousarray(array, dtype=WIRE_DTYPES[wire_name])
        specs.append({"name": str(name), "dtype": wire_name, "shape": [int(d) for d in array.shape]})
        buffers.append(array.reshape(-1).view(np.uint8).data)
    header = {
        "schema": SCHEMA_VERSION,
        "ver": int(ver),
        "actor": str(actor),
        "seq": int(seq),
        "created_at": float(time.time() if created_at is None else created_at),
        "n_segments": int(n_segments),
        "n_tokens": int(n_tokens),
        "channel": str(channel),
        "tensors": specs,
        "meta": dict(meta or {}),
    }
    return [_packb(header, "pack header"), *buffers]


def decode_pack_message(frames: Sequence[Any]) -> PackMessage:
    """Decode ``[header, buffer...]`` frames (bytes, memoryview, or ``zmq.Frame``) without copying arrays."""
    if isinstance(frames, (bytes, bytearray, memoryview)) or not isinstance(frames, Sequence):
        raise ProtocolError(f"a pack message is a list of frames, got {type(frames).__name__}")
    if not frames:
        raise ProtocolError("pack message has no frames (expected a header frame and one frame per tensor)")
    header = _unpack_map(frames[0], "pack header")
    _check_keys(header, PACK_HEADER_KEYS, "pack header")
    _check_schema(header["schema"], "pack header")
    for key in ("ver", "seq", "n_segments", "n_tokens"):
        _check_int(header[key], f"pack header {key!r}")
    _check_time(header["created_at"], "pack header 'created_at'")
    if not isinstance(header["actor"], str):
        raise ProtocolError(f"pack header 'actor' must be a string, got {type(header['actor']).__name__}")
    if header["channel"] not in ("A", "B"):
        raise ProtocolError(f"pack header 'channel' must be 'A' or 'B', got {header['channel']!r}")
    if not isinstance(header["meta"], dict):
        raise ProtocolError(f"pack header 'meta' must be a map, got {type(header['meta']).__name__}")
    specs = header["tensors"]
    if not isinstance(specs, list):
        raise ProtocolError(f"pack header 'tensors' must be a list, got {type(specs).__name__}")
    if len(frames) - 1 != len(specs):
        raise ProtocolError(
            f"pack message has {len(frames) - 1} buffer frames but the header lists {len(specs)} tensors"
        )
    tensors: dict[str, np.ndarray] = {}
    for i, (spec, frame) in enumerate(zip(specs, frames[1:])):
        name, dtype, shape = _check_tensor_spec(spec, i)
        if name in tensors:
            raise ProtocolError(f"tensor {name!r} is listed twice in the pack header")
        buf = _as_buffer(frame, f"frame {i + 1} (tensor {name!r})")
        expected = math.prod(shape) * dtype.itemsize
        if buf.nbytes != expected:
            raise ProtocolError(
                f"tensor {name!r}: frame has {buf.nbytes} bytes, dtype {dtype.name} shape {shape} needs {expected}"
            )
        try:
            tensors[name] = np.frombuffer(buf, dtype=dtype, count=math.prod(shape)).reshape(shape)
        except (ValueError, TypeError, BufferError) as exc:  # e.g. a non-contiguous exporter
            raise ProtocolError(f"tensor {name!r}: frame is not a readable contiguous buffer ({exc})") from None
    fields = {k: header[k] for k in PACK_HEADER_KEYS - {"tensors", "created_at"}}
    return PackMessage(**fields, created_at=float(header["created_at"]), tensors=tensors)


# ---------------------------------------------------------------------------------------------
# learner rank r -> actors (ZMQ back-channel): credits
# ---------------------------------------------------------------------------------------------


def encode_credits(
    *,
    rank: int,
    ver_current: int,
    depth: int,
    target: int,
    version_window: int,
    received_total: int,
    actors: Mapping[str, Sequence[int]] | None = None,
    ts: float | None = None,
    done: bool = False,
) -> bytes:
    """One frame for ``socket.send(...)``; ``actors`` maps actor id -> (last seq received, queued).

    ``done``: this is the rank's last message (it finished training); written only when True.
    """
    message = {
        "schema": SCHEMA_VERSION,
        "rank": int(rank),
        "ver_current": int(ver_current),
        "depth": int(depth),
        "target": int(target),
        "version_window": int(version_window),
        "received_total": int(received_total),
        "ts": float(time.time() if ts is None else ts),
        "actors": {str(a): [int(seq), int(queued)] for a, (seq, queued) in (actors or {}).items()},
    }
    if done:
        message["done"] = True
    return _packb(message, "credits")


def decode_credits(frame: Any) -> Credits:
    """Decode one credits frame (bytes, memoryview, ``zmq.Frame``, or a one-frame list)."""
    if isinstance(frame, (list, tuple)):
        if len(frame) != 1:
            raise ProtocolError(f"a credits message is one frame, got {len(frame)}")
        frame = frame[0]
    message = _unpack_map(frame, "credits")
    _check_keys(message, CREDITS_KEYS, "credits", optional=CREDITS_OPTIONAL_KEYS)
    _check_schema(message["schema"], "credits")
    if "done" in message and type(message["done"]) is not bool:
        raise ProtocolError(f"credits 'done' must be true or false, got {message['done']!r}")
    for key in CREDITS_KEYS - {"schema", "ts", "actors"}:
        _check_int(message[key], f"credits {key!r}")
    _check_time(message["ts"], "credits 'ts'")
    actors = message["actors"]
    if not isinstance(actors, dict):
        raise ProtocolError(f"credits 'actors' must be a map, got {type(actors).__name__}")
    for actor, entry in actors.items():
        if not isinstance(actor, str) or not isinstance(entry, list) or len(entry) != 2:
            raise ProtocolError(f"credits 'actors'[{actor!r}] must be [last_seq, queued], got {entry!r}")
        for value in entry:
            _check_int(value, f"credits 'actors'[{actor!r}]")
    return Credits(**{**message, "ts": float(message["ts"])})


# ---------------------------------------------------------------------------------------------
# checks shared by both codecs
# ---------------------------------------------------------------------------------------------


def _packb(obj: Any, what: str) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True, default=_msgpack_default)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"{what}: not msgpack-serialisable ({exc})") from None


def _msgpack_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):  # numpy scalars in meta counters
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def _as_buffer(frame: Any, what: str) -> memoryview:
    obj = getattr(frame, "buffer", frame)  # zmq.Frame exposes its bytes as .buffer
    try:
        view = memoryview(obj)
    except TypeError:
        raise ProtocolError(f"{what}: expected bytes, memoryview or zmq.Frame, got {type(frame).__name__}") from None
    if not view.c_contiguous:
        raise ProtocolError(f"{what}: buffer is not contiguous")
    return view


def _unpack_map(frame: Any, what: str) -> dict:
    buf = _as_buffer(frame, what)
    try:
        obj = msgpack.unpackb(buf, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types (ExtraData, FormatError, StackError, ValueError...)
        raise ProtocolError(f"{what}: not a msgpack document ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a msgpack map, got {type(obj).__name__}")
    return obj


def _check_keys(obj: dict, expected: frozenset, what: str, optional: frozenset = frozenset()) -> None:
    keys = set(obj)
    missing, extra = expected - keys, keys - expected - optional
    if missing or extra:
        parts = ([f"missing keys {sorted(missing)}"] if missing else []) + (
            [f"unknown keys {sorted(map(str, extra))}"] if extra else []
        )
        raise ProtocolError(f"{what}: {'; '.join(parts)}")


def _check_schema(value: Any, what: str) -> None:
    if type(value) is not int or value != SCHEMA_VERSION:
        raise ProtocolError(
            f"{what}: schema {value!r} != {SCHEMA_VERSION}; sender and receiver run different tandem versions"
        )


def _check_int(value: Any, what: str) -> None:
    if type(value) is not int or value < 0:
        raise ProtocolError(f"{what} must be a non-negative integer, got {value!r}")


def _check_time(value: Any, what: str) -> None:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ProtocolError(f"{what} must be a finite number of seconds, got {value!r}")


def _check_tensor_spec(spec: Any, index: int) -> tuple[str, np.dtype, tuple[int, ...]]:
    what = f"pack header tensors[{index}]"
    if not isinstance(spec, dict):
        raise ProtocolError(f"{what} must be a map, got {type(spec).__name__}")
    _check_keys(spec, _TENSOR_KEYS, what)
    name, dtype, shape = spec["name"], spec["dtype"], spec["shape"]
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{what} 'name' must be a non-empty string, got {name!r}")
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
        raise ProtocolError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
        raise ProtocolError(f"tensor {name!r}: shape must be a list of non-negative integers, got {shape!r}")
    return name, WIRE_DTYPES[dtype], tuple(shape)


# ---------------------------------------------------------------------------------------------
# actor -> learner rank r (ZMQ): a common.packing.segment.Pack as a pack message and back
# ---------------------------------------------------------------------------------------------


def pack_to_frames(
    pack: Pack, actor: str, seq: int, *, meta: Mapping[str, Any] | None = None, created_at: float | None = None
) -> list[bytes | memoryview]:
    """Frames of one pack: its ``PACK_TENSOR_SPECS`` arrays plus ``meta["segments"] = pack.segment_meta()``.

    ``meta`` is extra sender data (e.g. actor metrics) merged into the header meta; the key
    ``"segments"`` is reserved. Concatenating the segments copies once (``Pack.tensors``); the
    frames then view those arrays.
    """
    if meta and "segments" in meta:
        raise ValueError("pack meta key 'segments' is reserved for the per-segment layout")
    return encode_pack_message(
        ver=pack.ver,
        actor=actor,
        seq=seq,
        channel=pack.channel,
        n_segments=len(pack.segments),
        n_tokens=pack.n_tokens,
        tensors=pack.tensors(),
        meta={**(meta or {}), "segments": pack.segment_meta()},
        created_at=created_at,
    )


def frames_to_pack(frames: Sequence[Any]) -> tuple[PackMessage, Pack]:
    """Decode a pack message and rebuild its segments as views of the frames; ``ProtocolError`` if inconsistent."""
    message = decode_pack_message(frames)
    where = f"pack from {message.actor!r} seq {message.seq}"
    segment_meta = message.meta.get("segments")
    if not isinstance(segment_meta, list) or len(segment_meta) != message.n_segments:
        raise ProtocolError(f"{where}: meta['segments'] must list n_segments={message.n_segments} segments")
    try:
        pack = Pack.from_tensors(message.ver, message.channel, message.tensors, segment_meta)
    except SegmentError as exc:
        raise ProtocolError(f"{where}: {exc}") from None
    if pack.n_tokens != message.n_tokens:
        raise ProtocolError(f"{where}: header n_tokens={message.n_tokens} but the arrays hold {pack.n_tokens}")
    return message, pack
