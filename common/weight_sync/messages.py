"""The weight-sync messages: learner rank 0 -> rollout server, ``/sync/*`` (the rest of the rollout server's
HTTP contract is ``common/wire/http.py``; every link side by side: ``common/wire/__init__.py``; weight sync
as a whole, both halves of each step: ``common/weight_sync/__init__.py``).

Import them from here. The state machine they drive is :class:`SyncState`; the server side is
``rollout_server/weight_sync/session.py``, the client ``learner/weight_sync/session.py``.

What this module does not know: sockets, engines, torch. It imports pydantic only.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from common.wire.base import ContentError
from common.wire.base import Message as _Message

#: HTTP request header carrying the JSON :class:`SyncBucketHeader` of a ``POST /sync/bucket`` body.
BUCKET_HEADER = "X-Tandem-Bucket"
#: First bytes of a bucket-stream connection (rollout_server/weight_sync/stream.py, learner/weight_sync/stream.py).
STREAM_MAGIC = b"TANDEM-SYNC/1\n"
#: Tensor dtypes of the weight-sync manifest and buckets (torch names), with their byte size.
SYNC_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}
SyncDtype = Literal["bfloat16", "float16", "float32", "float64", "int64", "int32", "uint8"]
#: Largest weight version any message may carry: exact in JSON (a double), far inside int64 and msgpack (a ver
#: of 2**64 once crashed an actor's serialiser); 285,000 years of a sync every millisecond.
MAX_VER = 2**53 - 1
#: Largest step ``SyncCommitRequest.min_ver`` may ask above the server's ver (a learner resumed past a restarted
#: server continues from the checkpoint's ver); a typo such as 10**30 (ver never comes back down) is refused.
MAX_VER_JUMP = 1_000_000


class SyncState(StrEnum):
    """The server's weight-sync state machine (one client at a time; others get 409)::

        idle --init--> open --begin (fence closes)--> fenced --bucket*--> fenced --commit--> committing
        committing --(weights swapped, caches reset, ver += 1, fence opens)--> idle
        open | fenced --abort, error or session timeout--> idle (old weights, old ver)
    """

    IDLE = "idle"
    OPEN = "open"
    FENCED = "fenced"
    COMMITTING = "committing"


# =============================================================================================
# learner rank0 -> rollout server (HTTP, admin): POST /sync/{init,begin,bucket,update,commit,abort}
# Bearer token required when configured. Order: init -> begin -> bucket|update x n -> commit.
# GET /sync/digest (ops, tests) reads exact weight digests between sessions.
# =============================================================================================


class TensorSpec(_Message):
    """Name, dtype and shape of one served parameter.

    Example:
        {"name": "model.embed_tokens.weight", "dtype": "bfloat16", "shape": [152064, 2048]}
    """

    name: str = Field(min_length=1)
    """HF module name (no ``module.``/``_orig_mod.`` prefixes)."""
    dtype: SyncDtype
    """Serving dtype of this tensor (torch name)."""
    shape: list[int]
    """Dimensions, each >= 0."""

    @field_validator("shape")
    @classmethod
    def _dims_non_negative(cls, shape: list[int]) -> list[int]:
        if any(d < 0 for d in shape):
            raise ValueError(f"dimensions must be >= 0, got {shape}")
        return shape


class AdapterSpec(_Message):
    """The adapter an ``adapter`` session pushes instead of merged weights; the server merges it with peft into its
    kept base copy of each layer at every commit (tensor names and shapes: ``rollout_server/engines/adapter_merge.py``).

    Example:
        {"type": "dora", "rank": 8, "alpha": 16.0, "dtype": "float32", "layers": ["model.visual.merger.mlp.0"]}
    """

    type: Literal["lora", "dora"]
    """``lora``: W + (alpha / rank) B A; ``dora``: peft's ``use_dora`` (a learned per-row magnitude on top)."""
    rank: int = Field(ge=1)
    """LoRA rank r of every adapted layer."""
    alpha: float = Field(gt=0)
    """LoRA alpha: the update is scaled by alpha / rank."""
    dtype: SyncDtype
    """Dtype the adapter tensors travel in and the merge runs in (the learner's training dtype)."""
    layers: list[str] = Field(min_length=1)
    """HF module names of the adapted linear layers; ``<layer>.weight`` must be a served 2-D parameter."""


class SyncInitRequest(_Message):
    """Body of ``POST /sync/init``: open a sync session (idle -> open).

    Example:
        {"client": "learner-rank0", "transport": "http", "bucket_bytes": 536870912,
         "master_addr": null, "master_port": null, "world_size": null, "rank_offset": 1,
         "backend": "nccl", "timeout_s": 600.0, "skip": ["model.visual.patch_embed.proj.weight"], "adapter": null}
    """

    client: str = Field(min_length=1)
    """Who pushes, for logs and 409 messages (e.g. ``learner-rank0@host:pid``)."""
    transport: Literal["http", "nccl", "ipc"]
    """``http``: packed buckets in request bodies; ``nccl``: broadcast from learner rank 0; ``ipc``: the
    server copies each bucket out of the learner's memory (same GPU: CUDA IPC; CPU: a /dev/shm file)."""
    bucket_bytes: int = Field(512 * 2**20, ge=1)
    """Bytes per bucket, at most; one tensor larger than this travels alone."""
    master_addr: str | None = None
    """NCCL rendezvous host (learner rank 0); required for ``nccl``, None for ``http``."""
    master_port: int | None = Field(None, ge=1, le=65535)
    """NCCL rendezvous port; required for ``nccl``, None for ``http``."""
    world_size: int | None = Field(None, ge=2)
    """Weight-transfer group size = 1 (learner rank 0) + server workers; required for ``nccl``."""
    rank_offset: int = Field(1, ge=1)
    """Rank of the first server worker in that group (learner rank 0 is rank 0)."""
    backend: Literal["nccl", "gloo"] = "nccl"
    """The group's backend, as learner rank 0 builds it: ``nccl`` for weights on a GPU, ``gloo`` on
    CPU (only an engine on CPU joins a gloo group); a mismatch is refused before anyone waits."""
    timeout_s: float = Field(600.0, gt=0)
    """Seconds the whole session may take; past it the server aborts it and keeps the old weights."""
    weight_load: Literal["fast", "native"] | None = None
    """NCCL only: overrides ``rollout_server.weight_load`` for this session (the benchmark and the GPU
    tests compare the two load paths on one server); None keeps the server's setting."""
    skip: list[str] = Field(default_factory=list)
    """Served names frozen for the learner's run (equal to the checkpoint both loaded), not to be sent: accepted
    if served and unwritten by any commit since the server loaded (``SyncInitResponse.skip``), unknown: 400."""
    adapter: AdapterSpec | None = None
    """An ``adapter`` session (an engine that cannot merge answers 400); None: sent weights are served as is."""

    model_config = {"json_schema_extra": {
        "if": {"properties": {"transport": {"const": "nccl"}}, "required": ["transport"]},
        "then": {"required": ["master_addr", "master_port", "world_size"],
                 "properties": {k: {"not": {"type": "null"}} for k in ("master_addr", "master_port", "world_size")}},
        "else": {"properties": {"weight_load": {"type": "null"}}},
    }}

    @model_validator(mode="after")
    def _nccl_needs_rendezvous(self) -> SyncInitRequest:
        missing = [k for k in ("master_addr", "master_port", "world_size") if getattr(self, k) is None]
        if self.transport == "nccl" and missing:
            raise ValueError(f"transport 'nccl' needs {missing}")
        if self.transport != "nccl" and self.weight_load is not None:
            raise ValueError(f"weight_load applies to transport 'nccl' only; leave it null for {self.transport!r}")
        return self


class SyncInitResponse(_Message):
    """Reply to ``/sync/init``: what the server expects to receive.

    Example:
        {"session": "s-7f3a", "ver": 3, "dtype": "bfloat16",
         "manifest": [{"name": "lm_head.weight", "dtype": "bfloat16", "shape": [151936, 896]}],
         "tied": [["model.embed_tokens.weight", "lm_head.weight"]], "skip": [], "adapter_manifest": []}
    """

    session: str
    """Session id to quote in every later call."""
    ver: int = Field(ge=0, le=MAX_VER)
    """Server weight version now."""
    dtype: SyncDtype
    """Serving dtype floating-point weights are cast to before sending."""
    manifest: list[TensorSpec]
    """Every served parameter the learner must send, once each."""
    tied: list[list[str]] = Field(default_factory=list)
    """Groups of names sharing one storage; send only the first name of each group."""
    data_token: str | None = None
    """``http`` sessions: the secret a bucket stream connection quotes (``rollout_server/weight_sync/stream.py``:
    buckets on a raw connection to the same port instead of ``POST /sync/bucket`` bodies); None: not offered."""
    skip: list[str] = Field(default_factory=list)
    """The ``SyncInitRequest.skip`` names accepted: not sent this session; the fingerprint covers them as held."""
    skip_refused: str | None = None
    """Why some declared names were not accepted (the learner sends those); None: all accepted."""
    adapter_manifest: list[TensorSpec] = Field(default_factory=list)
    """``adapter`` sessions: the adapter tensors to send, instead of the adapted layers' ``.weight``; else empty."""


class SyncBeginRequest(_Message):
    """Body of ``POST /sync/begin``: close the fence (open -> fenced).

    Example:
        {"session": "s-7f3a", "mode": "drain", "expected_buckets": 4, "timeout_s": 60.0}
    """

    session: str
    """From ``SyncInitResponse.session``."""
    mode: Literal["drain", "abort"] = "drain"
    """``drain``: finish in-flight requests first; ``abort``: cut them (finish_reason ``abort``)."""
    expected_buckets: int | None = Field(None, ge=1)
    """Buckets the learner will send, for progress and an early check; None = not announced."""
    timeout_s: float = Field(60.0, gt=0)
    """Seconds to wait for the drain; past it the begin fails with ``sync_timeout`` and the fence reopens."""


class SyncBeginResponse(_Message):
    """Reply to ``/sync/begin`` once no request runs on the engine.

    Example:
        {"ver_before": 3, "drained": 12, "aborted": 0, "fence_s": 0.8, "spared": 0}
    """

    ver_before: int = Field(ge=0, le=MAX_VER)
    """Weight version the staged update will replace."""
    drained: int = Field(ge=0)
    """In-flight requests that finished before the fence closed."""
    aborted: int = Field(ge=0)
    """In-flight requests cut (``abort`` mode); their clients resubmit."""
    fence_s: float = Field(ge=0)
    """Seconds from the begin call to a quiet engine."""
    spared: int = Field(0, ge=0)
    """Of ``drained``: re-runs of batches an earlier abort fence cut, drained, not cut again (fence.py MAX_CUTS)."""


class SyncBucketHeader(_Message):
    """Layout of one bucket, enough to validate it before staging (state stays fenced).

    HTTP: JSON in the :data:`BUCKET_HEADER` request header of ``POST /sync/bucket``, whose body is the
    tensors' raw bytes packed end to end from byte 0 (``common/weight_sync/packed.py``: no gap, nothing
    after the last tensor). NCCL: body of ``POST /sync/update``, sent before rank 0 broadcasts one
    flat uint8 buffer; offsets are into that buffer. IPC: part of :class:`SyncIpcRequest`.

    Rules between fields (a 400 when broken: JSON Schema cannot state them): ``names``, ``dtypes``,
    ``shapes`` and ``offsets`` have one length; names do not repeat; each offset range spans exactly
    ``prod(shape) x dtype size`` bytes.

    Example:
        {"session": "s-7f3a", "index": 0, "names": ["lm_head.weight"], "dtypes": ["bfloat16"],
         "shapes": [[151936, 896]], "offsets": [[0, 272269312]]}
    """

    session: str
    """From ``SyncInitResponse.session``."""
    index: int = Field(ge=0)
    """Bucket number within the session, from 0, consecutive."""
    names: list[str] = Field(min_length=1)
    """Parameter names in the bucket, each from the manifest, no repeats within the session."""
    dtypes: list[SyncDtype]
    """Dtype of each tensor, parallel to ``names``."""
    shapes: list[list[int]]
    """Shape of each tensor, parallel to ``names``."""
    offsets: list[tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]]]
    """Byte range ``[begin, end)`` of each tensor in the bucket, parallel to ``names``."""

    @model_validator(mode="after")
    def _layout_consistent(self) -> SyncBucketHeader:
        n = len(self.names)
        if not len(self.dtypes) == len(self.shapes) == len(self.offsets) == n:
            raise ContentError("names, dtypes, shapes and offsets must have equal length")
        if len(set(self.names)) != n:
            raise ContentError("names repeat within the bucket")
        for name, dtype, shape, (begin, end) in zip(self.names, self.dtypes, self.shapes, self.offsets):
            if any(d < 0 for d in shape) or begin < 0:
                raise ContentError(f"{name}: negative dimension or offset")
            if end - begin != math.prod(shape) * SYNC_DTYPE_BYTES[dtype]:
                raise ContentError(f"{name}: offsets span {end - begin} bytes, {dtype} {shape} needs "
                                 f"{math.prod(shape) * SYNC_DTYPE_BYTES[dtype]}")
        return self


_B64 = r"^[A-Za-z0-9+/=]*$"


class SharedBuffer(_Message):
    """Where an ``ipc`` bucket lies in the learner's memory (:class:`SyncIpcRequest`).

    ``cuda``: a CUDA IPC handle of the learner's buffer, as ``torch.UntypedStorage._share_cuda_()``
    gives it (byte strings base64); the server opens it only on the GPU whose UUID is ``device_uuid``.
    ``shm``: a file under ``/dev/shm`` named ``tandem-sync-*``, mapped read-only. The bucket is bytes
    ``[offset, offset + nbytes)`` of the buffer. No pickle: every field is a plain value.

    Example:
        {"kind": "shm", "path": "tandem-sync-4242-1f2e3d4c", "size": 67108864, "offset": 0}
    """

    kind: Literal["cuda", "shm"]
    """``cuda``: GPU memory by CUDA IPC handle; ``shm``: a /dev/shm file."""
    offset: int = Field(0, ge=0)
    """Byte offset of the bucket in the buffer."""
    size: int = Field(ge=0)
    """Bytes of the buffer (cuda: of the storage)."""
    path: str | None = Field(None, pattern=r"^tandem-sync-[A-Za-z0-9-]{1,64}$")
    """shm: the file's name under /dev/shm."""
    device_uuid: str | None = Field(None, max_length=64)
    """cuda: ``torch.cuda.get_device_properties(d).uuid`` of the learner's GPU."""
    handle: str | None = Field(None, max_length=512, pattern=_B64)
    """cuda: the allocation's ``cudaIpcMemHandle`` (base64)."""
    storage_offset: int = Field(0, ge=0)
    """cuda: byte offset of the buffer's storage in that allocation."""
    ref_counter_handle: str | None = Field(None, max_length=512, pattern=_B64)
    """cuda: torch's shared reference counter (the learner keeps its buffer until the server lets go)."""
    ref_counter_offset: int = Field(0, ge=0)
    """cuda: the counter's slot."""
    event_handle: str | None = Field(None, max_length=512, pattern=_B64)
    """cuda: IPC event the server waits on before reading (base64; empty if none)."""
    event_sync_required: bool = False
    """cuda: whether to wait on ``event_handle``."""

    model_config = {"json_schema_extra": {
        "if": {"properties": {"kind": {"const": "shm"}}, "required": ["kind"]},
        "then": {"required": ["path"], "properties": {"path": {"type": "string"}}},
        "else": {"required": ["device_uuid", "handle", "ref_counter_handle"],
                 "properties": {k: {"type": "string"} for k in ("device_uuid", "handle", "ref_counter_handle")}},
    }}

    @model_validator(mode="after")
    def _kind_fields(self) -> SharedBuffer:
        need = ["path"] if self.kind == "shm" else ["device_uuid", "handle", "ref_counter_handle"]
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"kind {self.kind!r} needs {missing}")
        return self


class SyncIpcRequest(SyncBucketHeader):
    """Body of ``POST /sync/ipc``: one bucket the server copies out of the learner's memory.

    The layout fields are :class:`SyncBucketHeader`'s (offsets relative to ``source.offset``); the reply
    (:class:`SyncBucketResponse`) comes once the server has copied the bytes, so the learner may reuse
    its buffer for the next bucket. Besides the header's rules (a 400 when broken), the bucket must end
    inside the shared buffer: ``source.offset + offsets[-1][1] <= source.size``.

    Example:
        {"session": "s-7f3a", "index": 0, "names": ["model.norm.weight"], "dtypes": ["bfloat16"],
         "shapes": [[896]], "offsets": [[0, 1792]],
         "source": {"kind": "shm", "path": "tandem-sync-4242-1f2e3d4c", "size": 67108864, "offset": 0}}
    """

    source: SharedBuffer
    """Where the bucket's bytes are."""

    @model_validator(mode="after")
    def _fits(self) -> SyncIpcRequest:
        end = self.offsets[-1][1] if self.offsets else 0
        if self.source.offset + end > self.source.size:
            raise ContentError(f"the bucket ends at byte {self.source.offset + end}, the shared buffer has "
                             f"{self.source.size}")
        return self


class SyncBucketResponse(_Message):
    """Reply to ``/sync/bucket`` or ``/sync/update`` once the bucket is staged.

    Example:
        {"session": "s-7f3a", "index": 0, "n_tensors": 1, "nbytes": 272269312, "elapsed_s": 0.31}
    """

    session: str
    """Echo."""
    index: int = Field(ge=0)
    """Echo of ``SyncBucketHeader.index``."""
    n_tensors: int = Field(ge=0)
    """Tensors staged from this bucket."""
    nbytes: int = Field(ge=0)
    """Bytes received."""
    elapsed_s: float = Field(ge=0)
    """Seconds from request to staged."""
    load: dict[str, float | str | bool | None] | None = None
    """``/sync/update`` and ``/sync/ipc``: how the engine loaded it (vLLM: ``path`` fast|native, ``rpc_s`` worker
    call, ``worker_s`` / ``gpu_s`` receive+copy as the slowest worker timed it, ``one_call``)."""


class SyncCommitRequest(_Message):
    """Body of ``POST /sync/commit``: swap the staged weights in (fenced -> committing -> idle).

    Example:
        {"session": "s-7f3a", "n_buckets": 4, "fingerprint": "9c1e2a0b5d7f3e11"}
    """

    session: str
    """From ``SyncInitResponse.session``."""
    n_buckets: int = Field(ge=0)
    """Buckets sent; the commit fails (old weights kept) if the server staged a different number or the
    manifest is incomplete."""
    fingerprint: str | None = None
    """Learner-side weights fingerprint to compare after the swap; None = skip the comparison."""
    min_ver: int | None = Field(default=None, ge=0, le=MAX_VER)
    """Lowest ver this commit may produce: the server sets ``ver = max(previous + 1, min_ver)``.
    The learner passes its own ver + 1, so ver continues from ``max(server ver, checkpoint ver) + 1``
    after a learner resume or a server restart and never goes back. None = previous + 1. At most
    :data:`MAX_VER`, and at most :data:`MAX_VER_JUMP` above the server's ver (else a 422 naming
    ``min_ver``, and the session is aborted with the old weights kept)."""


class SyncCommitResponse(_Message):
    """Reply to ``/sync/commit``: the new weights are live and the fence is open.

    Example:
        {"ver": 4, "commit_s": 0.12, "fingerprint": "9c1e2a0b5d7f3e11"}
    """

    ver: int = Field(ge=0, le=MAX_VER)
    """New weight version: ``max(previous + 1, min_ver)``."""
    commit_s: float = Field(ge=0)
    """Seconds to swap weights and reset caches."""
    fingerprint: str
    """Server-side fingerprint of the weights now served."""


class SyncAbortRequest(_Message):
    """Body of ``POST /sync/abort``: drop the session and staged weights (any state but idle -> idle).

    Example:
        {"session": "s-7f3a", "reason": "learner rank 0 hit a NCCL timeout"}
    """

    session: str
    """From ``SyncInitResponse.session``."""
    reason: str | None = None
    """Logged by the server; None = no reason given."""


class SyncAbortResponse(_Message):
    """Reply to ``/sync/abort``.

    Example:
        {"ver": 3, "state": "idle", "aborted": true}
    """

    ver: int = Field(ge=0, le=MAX_VER)
    """Weight version still served (unchanged)."""
    state: SyncState
    """State after the abort (``idle``)."""
    aborted: bool
    """False when no such session was open (an abort is idempotent)."""


class SyncDigestResponse(_Message):
    """Reply to ``GET /sync/digest`` (bearer token like every ``/sync/*``; 409 while a session is open).

    One exact digest (``common.weight_sync.weights.exact_digest``: every element, not a sample) per
    engine worker holding weights; equal digests mean bit-identical weights across workers, or
    between two weight-load paths, or with the tensors the learner pushed (cast to the serving dtype).

    Example:
        {"engine": "vllm", "ver": 4, "digests": ["3f9c0e1ab2d47c55", "3f9c0e1ab2d47c55"]}
    """

    engine: str
    """``vllm`` or ``hf``."""
    ver: int = Field(ge=0, le=MAX_VER)
    """Weight version the digests were computed under."""
    digests: list[str] = Field(min_length=1)
    """Hex digest per worker (tensor x data parallel rank order); the hf engine has one."""
