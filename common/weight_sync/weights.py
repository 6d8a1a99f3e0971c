"""Weight tensors on both ends of a sync: names, manifest, fingerprint, exact digest, the packing rule.

Imported by the learner-side sender (:mod:`learner.weight_sync.http`) and by the engines, so the
two sides compute names and fingerprints with the same code. Imports torch only
(no fastapi, no transformers): the learner can use it without the server's dependencies.

Buckets on the wire (tensors packed end to end, the layout as JSON beside them) are
:mod:`common.weight_sync.packed`; this module gives the packing rule (:func:`packed_chunks`,
:func:`packed_offsets`) every transport shares. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator

import torch

from common.weight_sync.messages import SYNC_DTYPE_BYTES, TensorSpec

#: Elements sampled per tensor by :func:`fingerprint` (evenly spaced, first and last included).
FINGERPRINT_SAMPLES = 4096

#: Elements :func:`exact_digest` widens at a time (4 int64 temporaries of 128 MiB each at most).
DIGEST_CHUNK = 1 << 24
#: Position weights of :func:`exact_digest` cycle with this period (Adler-32's prime, < 2**16).
DIGEST_MODULUS = 65521
#: Raw-bit integer view per element size; 1-byte elements read unsigned.
_BITS_AS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16 -> "bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16" -> torch.bfloat16``; ValueError for names outside the protocol's list."""
    if name not in SYNC_DTYPE_BYTES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(SYNC_DTYPE_BYTES)}")
    return getattr(torch, name)


def hf_name(name: str) -> str:
    """The HF module's own parameter name: drop DDP's ``module.`` prefix and torch.compile's
    ``_orig_mod.`` wherever it sits (``module._orig_mod.model.x`` -> ``model.x``)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name.replace("_orig_mod.", "")


def manifest_of(model: torch.nn.Module) -> tuple[list[TensorSpec], list[list[str]]]:
    """Served parameters (tied groups once, under their first name) and the tied groups.

    The first name of a group is the one ``named_parameters()`` keeps, which is the same on the
    learner's copy of the architecture.
    """
    by_storage: dict[int, list[str]] = {}
    params: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = hf_name(name)
        by_storage.setdefault(id(p), []).append(name)
        params.setdefault(name, p)
    manifest, tied = [], []
    for names in by_storage.values():
        p = params[names[0]]
        manifest.append(TensorSpec(name=names[0], dtype=dtype_name(p.dtype), shape=list(p.shape)))
        if len(names) > 1:
            tied.append(names)
    return manifest, tied


def fingerprint(named: Iterable[tuple[str, torch.Tensor]], dtypes: dict[str, str] | None = None) -> str:
    """A cheap deterministic hash over weights: name, dtype, shape and a fixed sample of values.

    Samples :data:`FINGERPRINT_SAMPLES` evenly spaced elements per tensor (raw bytes, no float
    arithmetic), so it costs O(#tensors), is identical on CPU and GPU for the same values, and
    changes with any re-initialisation or training step. It is a check that both sides hold the
    same weights, not a proof: a change confined to unsampled elements goes unseen.

    ``dtypes`` (name -> dtype name) hashes each tensor as if cast to that dtype first (the learner
    fingerprints what the server will hold without casting whole tensors).

    The samples of all tensors on one device are gathered there and copied to the host at once: one
    device sync per device instead of one per tensor (~700 syncs were ~35 ms of a blocking sync's
    stall on a GPU). The hashed bytes are the same as hashing tensor by tensor.
    """
    heads: list[bytes] = []
    samples: list[torch.Tensor] = []
    index: dict[tuple[int, torch.device], torch.Tensor] = {}
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach()
        flat = t.reshape(-1)
        n = flat.numel()
        if n > FINGERPRINT_SAMPLES:
            key = (n, flat.device)
            if key not in index:
                # Integer arithmetic: a float32 linspace rounds n - 1 past the end for n > 2**24.
                index[key] = torch.arange(FINGERPRINT_SAMPLES, device=flat.device) * (n - 1) // (FINGERPRINT_SAMPLES - 1)
            flat = flat[index[key]]
        dtype = dtypes.get(name) if dtypes else None
        if dtype is not None and t.is_floating_point():
            flat = flat.to(torch_dtype(dtype))
        heads.append(f"{name}|{dtype_name(flat.dtype)}|{list(t.shape)}|".encode())
        samples.append(flat.contiguous().view(torch.uint8))
    host: list[bytes] = [b""] * len(samples)
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(samples):
        by_device.setdefault(x.device, []).append(i)
    for idx in by_device.values():
        blob, pos = torch.cat([samples[i] for i in idx]).cpu().numpy().tobytes(), 0
        for i in idx:
            host[i], pos = blob[pos:pos + samples[i].numel()], pos + samples[i].numel()
    h = hashlib.blake2b(digest_size=8)
    for head, data in zip(heads, host):
        h.update(head)
        h.update(data)
    return h.hexdigest()


def exact_digest(named: Iterable[tuple[str, torch.Tensor]], *, chunk_elems: int = DIGEST_CHUNK) -> str:
    """A deterministic hash over EVERY element of the weights, to check that two copies are bit-identical.

    :func:`fingerprint` samples 4096 values per tensor, so it cannot tell two servers apart whose
    weights differ elsewhere (e.g. after two different weight-load paths). This digest reads all of
    them, and stays cheap on a GPU: per tensor (sorted by name) it reads each element's raw bits as
    an unsigned integer ``u_i`` and computes, on the tensor's own device,

        s1 = sum(u_i)        s2 = sum(u_i * (i % 65521 + 1))     (i = flat row-major index)

    then hashes ``name|dtype|shape|s1|s2`` with blake2b. Only two integers per tensor reach the host.
    ``s1`` sees any change of value, ``s2`` also a permutation (two elements swapped, unless their
    indices differ by a multiple of 65521). All arithmetic is on integers and exact: elements are
    split into 16-bit limbs so no partial sum can overflow int64, and chunk sums are added up in
    Python ints, so CPU and GPU, any chunk size and any reduction order give the same digest.

    Memory stays bounded: ``chunk_elems`` elements are widened at a time; a non-contiguous tensor
    is copied one bounded block at a time, never whole. Inputs are not modified. Dtype and shape are
    hashed too, so the same values held as float32 and as bfloat16 digest differently.
    """
    if not 1 <= chunk_elems <= 1 << 30:  # a limb (< 2**16) times a weight (< 2**16), summed: < 2**62
        raise ValueError(f"chunk_elems must be in [1, 2**30], got {chunk_elems}")
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach()
        s1, s2 = _exact_sums(t, chunk_elems)
        h.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|{s1}|{s2}|".encode())
    return h.hexdigest()


def _exact_sums(t: torch.Tensor, chunk_elems: int) -> tuple[int, int]:
    """``(sum u_i, sum u_i * (i % DIGEST_MODULUS + 1))`` over the raw bits ``u_i`` of ``t`` (:func:`exact_digest`)."""
    size = t.element_size()
    as_int = _BITS_AS.get(size)
    if as_int is None:
        raise TypeError(f"exact_digest: no integer view for {t.dtype} ({size}-byte elements)")
    bits = t if t.dtype == as_int else t.view(as_int)
    n_limbs = max(1, size // 2)
    parts: list[torch.Tensor] = []  # per chunk, per 16-bit limb: (sum, weighted sum), all < 2**63
    for start, chunk in _flat_chunks(bits, chunk_elems):
        x = chunk.to(torch.int64)
        w = torch.arange(start, start + x.numel(), dtype=torch.int64, device=x.device)
        w.remainder_(DIGEST_MODULUS).add_(1)
        for k in range(n_limbs):
            limb = x if size == 1 else (x >> (16 * k)) & 0xFFFF
            parts += [limb.sum(), (limb * w).sum()]
    if not parts:
        return 0, 0
    s1 = s2 = 0
    for j, (a, b) in enumerate(zip(*[iter(torch.stack(parts).tolist())] * 2)):  # one host sync per tensor
        shift = 16 * (j % n_limbs)
        s1 += a << shift
        s2 += b << shift
    return s1, s2


def _flat_chunks(t: torch.Tensor, n: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """``(flat index of the first element, 1-D chunk of at most n elements)`` in row-major order.

    A contiguous tensor is sliced as views; a non-contiguous one is walked by blocks of whole rows
    (recursing into a row bigger than ``n``), so a copy never holds more than ``n`` elements.
    """
    if t.is_contiguous():
        flat = t.reshape(-1)
        for a in range(0, flat.numel(), n):
            yield start + a, flat[a:a + n]
    elif t.dim() == 1:
        for a in range(0, t.numel(), n):
            yield start + a, t[a:a + n].contiguous()
    else:
        row = t[0].numel()
        rows = n // row if row else t.shape[0]
        if rows >= 1:
            for a in range(0, t.shape[0], rows):
                yield start + a * row, t[a:a + rows].reshape(-1)
        else:
            for a in range(t.shape[0]):
                yield from _flat_chunks(t[a], n, start + a * row)


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Group tensors in order into dicts of at most ``bucket_bytes`` (a bigger tensor goes alone)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket


def packed_chunks(nbytes: Iterable[int], buffer_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each packed NCCL broadcast, for tensors of ``nbytes`` in order.

    The rule is vLLM's (``weight_transfer/packed_tensor.py``, 0.26): add tensors to a chunk until its
    size *exceeds* ``buffer_bytes``, then that chunk (including the tensor that crossed) is one
    broadcast. Both ends of a sync must cut the stream identically, so the learner's sender and the
    hf engine's receiver use this one function; vLLM's consumer uses its own copy of the rule.

    Example: ``packed_chunks([4, 4, 4, 10, 1], 8) == [[0, 1, 2], [3], [4]]``.
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(nbytes):
        current.append(i)
        size += int(n)
        if size > buffer_bytes:
            chunks.append(current)
            current, size = [], 0
    if current:
        chunks.append(current)
    return chunks


def packed_offsets(specs: Iterable[tuple[str, list[int]]]) -> list[tuple[int, int]]:
    """Byte ranges ``[begin, end)`` of tensors ``(dtype name, shape)`` laid end to end (the
    ``SyncBucketHeader.offsets`` of a ``/sync/update`` announcing a whole packed stream)."""
    out, pos = [], 0
    for dtype, shape in specs:
        n = SYNC_DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        out.append((pos, pos + n))
        pos += n
    return out


class TorchTransferGroup:
    """A stand-alone weight-transfer group (NCCL on GPUs, gloo on CPU), never the default/DDP group.

    Rank 0 (learner rank 0) hosts the rendezvous ``TCPStore`` on ``master_port``; ranks >= 1 (server
    workers) connect to it. Host-side waits go through :func:`wait_work`, so a dead peer becomes a
    TimeoutError after ``timeout_s`` instead of a hang (or a process teardown by NCCL's watchdog);
    :meth:`abort` then frees the communicator.
    Used by the learner's sender (``learner/weight_sync/nccl.py``) and the hf engine's receiver; the vLLM
    engine uses vLLM's own rendezvous (``StatelessProcessGroup`` + ``PyNcclCommunicator``) instead.
    """

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, *, backend: str,
                 timeout_s: float) -> None:
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend, self.timeout_s = rank, world_size, backend, timeout_s
        self.store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout,
                                   wait_for_workers=False)
        prefixed = dist.PrefixStore("tandem-weight-sync", self.store)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            # NOTE: NCCL's own watchdog tears the whole process down when a collective times out
            # (TORCH_NCCL_ASYNC_ERROR_HANDLING), which would kill the learner for a dead server. Our
            # host waits carry the deadline instead (wait_work) and abort the group themselves.
            opts._timeout = datetime.timedelta(days=1)
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.distributed.Work:
        """Start a broadcast of ``tensor`` from ``src`` (in place on receivers); wait with :func:`wait_work`."""
        return self.pg.broadcast([tensor], broadcast_opts(src))

    def abort(self) -> None:
        """Tear the communicator down (after a timeout it is unusable); best effort."""
        fn = getattr(self.pg, "abort", None) or getattr(self.pg, "shutdown", None)
        if fn is not None:
            fn()


def broadcast_opts(root: int = 0) -> torch.distributed.BroadcastOptions:
    """``BroadcastOptions`` from ``root`` for a stand-alone group's ``broadcast([t], opts)``."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    return opts


def wait_work(work: torch.distributed.Work, timeout_s: float, what: str) -> None:
    """Wait for a collective on the host, with a deadline: a raw NCCL wait never times out, so poll.

    Raises TimeoutError naming ``what`` once ``timeout_s`` pass, or the collective's own error.
    """
    end = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > end:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what}; the peer is gone or stuck")
        time.sleep(0.0005)
    work.wait()  # raises the collective's own error; on NCCL it also orders the current stream after it
