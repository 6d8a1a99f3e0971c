"""The NCCL weight-sync path without vLLM: learner sender -> hf engine receiver.

* CPU (always runs): the packed protocol between ``learner/weight_sync/nccl.py``'s broadcaster and the hf
  engine's receiver, over a stand-alone gloo group in two spawned processes (chunk boundaries,
  dtype casts, names, offsets).
* GPU (``-m gpu``, 2 GPUs): a real hf rollout server on GPU 0 receives from this process on GPU 1
  over NCCL; the served fingerprint and the greedy outputs equal the learner's; a server frozen
  mid-sync becomes a SyncError within the deadline, not a hang.
* GPU, FSDP2 (``learner.parallel: fsdp``; the worker and its assertions are tests/test_sync_fsdp.py's,
  which runs the 2-rank CPU version): a 1-rank sharded learner, its shards on the GPU or offloaded
  to the host, pushes bucket by bucket gathered on the GPU, cast to the server's bfloat16 before the
  gather: over CUDA IPC and HTTP to an hf server on the same GPU (1 GPU), in blocking and overlap
  mode, and over NCCL to a server on another GPU (2 GPUs); the served digest equals torch's own full
  state dict's.

Run the GPU part on a GPU machine: ``make test-gpu`` (docs/gpu.md).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from common.weight_sync import weights as W
from tests.ports import free_port_block
from tests.server_proc import rollout_server_process

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
needs_two_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs (server on GPU 0, learner on GPU 1): "
                                    "run `make test-gpu` on a GPU machine")

SHAPES = [[3, 5], [7], [40, 3], [2], [9, 9]]


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _sender(port: int, out: str) -> None:
    from learner.weight_sync.nccl import _Broadcaster, _TorchGroup

    group = _TorchGroup("127.0.0.1", port, 2, 20.0, "gloo", torch.device("cpu"))
    ts = _tensors()
    chunks = W.packed_chunks([t.numel() * 2 for t in ts], 128)
    b = _Broadcaster(group, [(t, torch.bfloat16) for t in ts], chunks, time.monotonic() + 20, None)
    b.start()
    b.join(time.monotonic() + 20)
    Path(out).write_text(json.dumps({"chunks": chunks}))
    # A gloo broadcast can complete on the sender before the receiver has the bytes: stay in the group until
    # the receiver has written its result, so our exit never tears a connection from under its last receive.
    done, end = Path(out).with_name("r.json"), time.monotonic() + 30
    while not done.exists() and time.monotonic() < end:
        time.sleep(0.05)


def _receiver(port: int, out: str) -> None:
    import types

    from common.weight_sync.messages import SyncBucketHeader
    from rollout_server.engines.hf import HFEngine

    engine = HFEngine("unused")
    engine.gen = types.SimpleNamespace(device=torch.device("cpu"))
    engine._group = W.TorchTransferGroup("127.0.0.1", port, 1, 2, backend="gloo", timeout_s=20.0)
    W.wait_work(engine._group.broadcast(torch.zeros(1)), 20.0, "warm-up")
    engine._bucket_bytes, engine._group_timeout_s = 128, 20.0
    specs = [("bfloat16", s) for s in SHAPES]
    names = [f"t{i}" for i in range(len(SHAPES))]
    header = SyncBucketHeader(session="s", index=0, names=names, dtypes=["bfloat16"] * len(SHAPES), shapes=SHAPES,
                              offsets=W.packed_offsets(specs))
    got = engine._receive(header)
    ok = [torch.equal(got[n], t.to(torch.bfloat16)) for n, t in zip(names, _tensors())]
    Path(out).write_text(json.dumps({"ok": ok}))


def test_packed_broadcast_protocol_round_trips_over_a_gloo_group_on_cpu(tmp_path):
    port = free_port_block(1)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_sender, args=(port, str(tmp_path / "s.json"))),
             ctx.Process(target=_receiver, args=(port, str(tmp_path / "r.json")))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"ranks {alive} still running after 60s: the two ends disagree on the chunking"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert json.loads((tmp_path / "r.json").read_text())["ok"] == [True] * len(SHAPES)
    assert len(json.loads((tmp_path / "s.json").read_text())["chunks"]) > 1, "the test must cross chunk boundaries"


# ------------------------------------------------------------------------------------ GPU: hf engine


def hf_server_on_gpu0(model_dir: Path):
    """The hf engine on GPU 0 (float32); killed at the end, as a test may leave it frozen mid-sync."""
    return rollout_server_process(model_dir, ["rollout_server.device=cuda", "rollout_server.dtype=float32",
                                              "rollout_server.sync_idle_timeout_s=30"],
                                  env={"CUDA_VISIBLE_DEVICES": "0"}, deadline_s=120, stop_signal=signal.SIGKILL)


@pytest.fixture(scope="module")
def learner_model(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    from common.generation.generator import HFGenerator
    from common.data.processor import load_processor

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).to("cuda:1")
    return model, HFGenerator(model, load_processor(str(tiny_model_dir)), device="cuda:1", max_batch=4)


@pytest.mark.gpu
@needs_two_gpus
def test_nccl_push_to_the_hf_engine_lands_every_weight_under_its_name(tiny_model_dir, learner_model):
    from learner.weight_sync.nccl import NcclWeightSender
    from tests.test_collective_sync_cpu import assert_served_greedy_is_the_learners
    from tests.test_fence import version_weights

    model, gen = learner_model
    base = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    with hf_server_on_gpu0(tiny_model_dir) as srv:
        sender = NcclWeightSender(srv.url, timeout_s=60)
        for k in (1, 2):
            model.load_state_dict(version_weights(base, k), strict=False)
            report = sender.push(model.named_parameters(), bucket_bytes=64 << 10)
            assert report.ver == k and report.n_buckets > 1
            assert report.fingerprint == W.fingerprint(list(model.named_parameters()))  # computed by the server
            assert_served_greedy_is_the_learners(srv.url, gen, k)
        assert sender.groups_created == 1, "the group must be reused across syncs"
        sender.close()


@pytest.mark.gpu
@needs_two_gpus
def test_a_server_frozen_mid_sync_is_a_sync_error_within_the_deadline_not_a_hang(tiny_model_dir, learner_model):
    from learner.weight_sync.nccl import NcclWeightSender
    from learner.weight_sync.session import SyncError

    model, _ = learner_model
    with hf_server_on_gpu0(tiny_model_dir) as srv:
        sender = NcclWeightSender(srv.url, timeout_s=15)
        sender.push(model.named_parameters(), bucket_bytes=64 << 10)  # builds the group
        t0 = time.monotonic()
        with pytest.raises(SyncError) as err:
            sender.push(model.named_parameters(), bucket_bytes=64 << 10,
                        on_phase=lambda phase: os.kill(srv.proc.pid, signal.SIGSTOP))
        elapsed = time.monotonic() - t0
        assert elapsed < 15 + 20, f"the push took {elapsed:.0f}s to give up (deadline 15s + abort 10s)"
        assert err.value.phase in ("update", "wire"), err.value
        assert sender._group is None, "a group that saw a dead peer must be dropped"
        sender.close()


# ------------------------------------------------------------------------------------ GPU: sharded (FSDP2) learner


def _sharded_push(tiny_model_dir: Path, tmp_path: Path, offload: bool, transports: str, overlap: str,
                  server_gpu: str, learner_gpu: str) -> dict:
    """Scenario ``land`` of tests/test_sync_fsdp.py with one rank on ``learner_gpu``; rank 0's results."""
    from tests.test_sync_fsdp import _run

    with rollout_server_process(tiny_model_dir, ["rollout_server.device=cuda"],  # auto: bfloat16 on CUDA
                                env={"CUDA_VISIBLE_DEVICES": server_gpu}, deadline_s=120) as srv:
        (r0,) = _run(tmp_path, "land", [srv.url], tiny_model_dir, nproc=1, env={"CUDA_VISIBLE_DEVICES": learner_gpu},
                     extra=["--device=cuda", f"--transports={transports}", f"--overlap-transport={overlap}",
                            *(["--offload"] if offload else [])])
    for push in [*transports.split(","), "overlap"]:
        r = r0[push]
        assert r["ok"] and r["served"]["digests"] == [r["expected"]["digest"]], (push, r)
        assert r["gathers"] == (0 if push == "overlap" else r["expected"]["n_served"]), (push, r["gathers"])
    assert r0["overlap"]["served"]["digests"] != [r0["overlap"]["moved_on"]["digest"]], "the snapshot's weights"
    return r0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run `make test-gpu` on a GPU machine")
@pytest.mark.parametrize("offload", [False, True], ids=["shards-on-gpu", "cpu-offload"])
def test_a_sharded_learner_on_one_gpu_lands_bit_exact_over_cuda_ipc_and_http(tiny_model_dir, tmp_path, offload):
    _sharded_push(tiny_model_dir, tmp_path, offload, "http,ipc", "ipc", server_gpu="0", learner_gpu="0")


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("offload", [False, True], ids=["shards-on-gpu", "cpu-offload"])
def test_a_sharded_learner_lands_bit_exact_over_nccl_gathering_on_the_broadcast_thread(tiny_model_dir, tmp_path,
                                                                                      offload):
    _sharded_push(tiny_model_dir, tmp_path, offload, "nccl", "nccl", server_gpu="0", learner_gpu="1")


@pytest.mark.gpu
@needs_two_gpus
def test_two_sharded_ranks_on_two_gpus_push_overlap_snapshots_from_their_own_shards(tiny_model_dir, tmp_path):
    """Scenario ``land`` of tests/test_sync_fsdp.py on 2 NCCL ranks (GPUs 0 and 1, the hf server on GPU 0): the
    overlap snapshot copies each rank's shards on a side stream into pinned memory and rank 0 receives rank 1's
    over gloo; a missing rank's shards fail one push, the next gathers; uneven shards assemble exactly."""
    from tests.test_sync_fsdp import _run

    with rollout_server_process(tiny_model_dir, ["rollout_server.device=cuda"], env={"CUDA_VISIBLE_DEVICES": "0"},
                                deadline_s=120) as srv:
        r0, r1 = _run(tmp_path, "land", [srv.url], tiny_model_dir, nproc=2, env={"CUDA_VISIBLE_DEVICES": "0,1"},
                      extra=["--device=cuda", "--transports=http", "--overlap-transport=http"])
    o, unsent, after = r0["overlap"], r0["overlap_unsent"], r0["overlap_after"]
    assert o["ok"] and o["served"]["digests"] == [o["expected"]["digest"]] != [o["moved_on"]["digest"]]
    assert o["gathers"] == r1["overlap"]["gathers"] == 0 and o["moved"] == r1["overlap"]["moved"] > 0
    assert not unsent["ok"] and unsent["broken"] and after["ok"] and after["gathers"] == after["expected"]["n_served"]
    assert after["served"]["digests"] == [after["expected"]["digest"]]
    assert r0["uneven"]["equal"] == [True] * 4 and r0["uneven"]["moved"] == 2
