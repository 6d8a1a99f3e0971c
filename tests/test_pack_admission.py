"""Packs with bad values never reach training: admission at the receiver, a size cap on the pack socket,
and an optimizer step skipped (weights untouched, counted) when a loss or gradient is not finite."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from common.packing.segment import REJECT_REASONS, Pack, PackLimits
from common.wire.transport import PackReceiver, max_frame_bytes
from common.wire.codec import pack_to_frames
from learner.pack_queue import REJECTED, ReadyQueue
from tests.factories import GRID_THW, PATCH_DIM, make_segment
from tests.ports import free_port_block

VOCAB = 151_000  # make_segment draws ids below 150 000
IMAGE_TOKEN = 150_500
LIMITS = PackLimits(packing_length=64, vocab_size=VOCAB, rope_rows=3, image_token_id=IMAGE_TOKEN, patch_dim=PATCH_DIM,
                    merge_size=2, meta_counts=("n_pred",))


def segment(sample_id: str, n_images: int = 0, length: int = 24, ver: int = 0):
    seg = make_segment(length, ver, sample_id, n_images=n_images)
    if n_images:  # the placeholders the model expects: t·h·w / merge² per image, after the first token
        n = n_images * int(np.prod(GRID_THW)) // 4
        seg.input_ids[1:1 + n] = IMAGE_TOKEN
    return seg


def frames_of(seg, ver: int = 0, seq: int = 0, actor: str = "actor-r0-7"):
    return pack_to_frames(Pack(ver=ver, channel="B", segments=[replace(seg, ver=ver)]), actor, seq)


def spoiled(what: str):
    """A pack whose layout is sound but one value is not (keyed by the reason it must be rejected for)."""
    seg = segment(what, n_images=1)
    if what == "nonfinite":
        seg.weights[3] = np.nan
    elif what == "nonfinite_pixels":
        seg.pixel_affine[0, 0] = np.inf  # uint8 pixels are finite; their normalisation may not be
    elif what == "token_id":
        seg.input_ids[5] = VOCAB + 7
    elif what == "token_id_label":
        seg.labels[np.flatnonzero(seg.labels != -100)[0]] = 10**9
    elif what == "too_long":
        seg = segment(what, length=65)
    elif what == "weight":
        seg.weights[np.flatnonzero(seg.labels != -100)[0]] = -1.0
    elif what == "position":
        seg = replace(seg, position_ids=seg.position_ids[:1])
    elif what == "position_value":
        seg.position_ids[0, 4] = 10**12
    elif what == "image":
        seg.input_ids[1] = 7  # one placeholder fewer than the grid implies
    elif what == "image_width":
        seg = replace(seg, pixel_values=np.zeros((4, PATCH_DIM + 1), np.uint8),
                      pixel_affine=np.ones((2, PATCH_DIM + 1), np.float32))
    elif what == "meta":
        seg.meta["n_pred"] = float("nan")
    return seg


EXPECTED = {"nonfinite": "nonfinite", "nonfinite_pixels": "nonfinite", "token_id": "token_id",
            "token_id_label": "token_id", "too_long": "too_long", "weight": "weight", "position": "position",
            "position_value": "position", "image": "image", "image_width": "image", "meta": "meta"}


def test_every_bad_value_is_rejected_and_counted_by_reason_and_the_books_balance(caplog):
    q = ReadyQueue(rank=0, queue_limit=8, version_window=1, target=4, ver_current=3, limits=LIMITS)
    assert q.push_frames(frames_of(segment("good", n_images=1), ver=3, seq=0))
    for seq, what in enumerate(EXPECTED, start=1):
        assert not q.push_frames(frames_of(spoiled(what), ver=3, seq=seq)), what
    assert not q.push_frames(frames_of(segment("from-the-future"), ver=10**12, seq=99))
    c = q.check_conservation()  # received == queued + every drop and reject, by reason
    counts = {r: c[f"rejected_{r}"] for r in REJECT_REASONS}
    want = {r: list(EXPECTED.values()).count(r) for r in REJECT_REASONS} | {"future_ver": 1}
    assert counts == want and c["received"] == 1 + len(EXPECTED) + 1 and c["in_queue"] == 1
    assert "from 'actor-r0-7' seq 99 ver 1000000000000" in caplog.text  # logged with the sender


def test_a_pack_one_sync_ahead_is_admitted_and_two_ahead_is_not():
    q = ReadyQueue(rank=0, queue_limit=8, version_window=1, target=4, ver_current=5)
    assert q.push_frames(frames_of(segment("next"), ver=6))  # the server committed, the learner adopts next step
    assert not q.push_frames(frames_of(segment("later"), ver=7, seq=1))
    assert q.check_conservation()["rejected_future_ver"] == 1


def test_rejects_are_logged_at_most_once_per_kind_per_interval_and_the_rest_counted(caplog):
    q = ReadyQueue(rank=0, queue_limit=8, version_window=1, target=4, limits=LIMITS)
    with caplog.at_level(logging.WARNING, logger="learner.pack_queue"):
        for seq in range(50):
            q.push_frames(frames_of(spoiled("nonfinite"), seq=seq))
    assert q.snapshot()["rejected_nonfinite"] == 50
    assert len([r for r in caplog.records if "rejected (nonfinite)" in r.getMessage()]) == 1
    assert set(REJECTED) <= set(q.snapshot())


def test_the_pack_socket_drops_a_peer_that_sends_a_frame_above_the_cap_and_keeps_serving():
    port = free_port_block(1)
    receiver = PackReceiver(f"tcp://127.0.0.1:{port}", max_frame_bytes=4096)
    ctx = zmq.Context.instance()
    liar, honest = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    try:
        for s in (liar, honest):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{port}")
        liar.send_multipart([b"h" * 100, b"x" * 100_000])  # one frame 25× the cap (a 4 GiB one is refused alike)
        assert receiver.recv(0.5) is None, "the oversized message was delivered"
        honest.send_multipart([b"h" * 100, b"y" * 4000])
        frames = receiver.recv(5.0)
        assert frames is not None and [len(f.bytes) for f in frames] == [100, 4000]
    finally:
        liar.close()
        honest.close()
        receiver.close()


def test_the_default_cap_covers_the_biggest_legal_pack_of_the_packing_length():
    cfg = SimpleNamespace(max_frame_mb=None)
    qwen = replace(LIMITS, packing_length=4096, patch_dim=1536)  # Qwen3-VL patches, the widest of the family
    assert qwen.largest_frame_bytes() < max_frame_bytes(cfg, 4096) < 4 * qwen.largest_frame_bytes()
    assert max_frame_bytes(SimpleNamespace(max_frame_mb=8), 4096) == 8 << 20


# --------------------------------------------------------------------------------------------- the learner


@pytest.fixture(scope="module")
def learner(tmp_path_factory, tiny_model_dir, synth_data_dir):
    """A real one-rank learner (tiny model, Channel-A data, its ready queue bound), no rollout server."""
    lrn = _fresh_learner(tmp_path_factory.mktemp("admission"), tiny_model_dir, synth_data_dir, ["training.lr=1e-2"])
    lrn.open_queue()
    lrn.setup()
    yield lrn
    lrn.close()


def params(lrn) -> dict:
    return {n: p.detach().clone() for n, p in lrn.hf_model.named_parameters()}


def a_step(lrn, spoil: bool) -> None:
    """One Channel-A optimizer step through the learner's own pieces; ``spoil``: NaN loss weights in its first pack."""
    from learner.step_record import StepRecord

    record = StepRecord()
    stats = record.stats
    arrays = [dict(a) for a in lrn.take_a_window(stats).arrays]
    if spoil:
        arrays[0]["weights"] = np.full_like(arrays[0]["weights"], np.nan)
    inputs = [lrn.inputs(a) for a in arrays]
    norm = lrn.global_normaliser(inputs)
    for i, inp in enumerate(inputs):
        lrn.forward_backward(inp, norm, stats, channel="A", sync_grads=i == len(inputs) - 1)
    lrn.finish_step(record)


def test_the_queue_takes_its_limits_from_the_model(learner):
    lim = learner.queue.limits
    emb = learner.hf_model.get_input_embeddings().weight.shape[0]
    assert (lim.vocab_size, lim.packing_length, lim.rope_rows) == (emb, 768, 3)
    assert lim.image_token_id == learner.hf_model.config.image_token_id and lim.merge_size == 2
    assert lim.largest_frame_bytes() <= max_frame_bytes(learner.cfg.transport, 768)  # checked at setup
    from common.packing.segment import pack_rejection
    from learner.step_record import RankStats

    window = learner.take_a_window(RankStats())  # real encoded packs (images, mRoPE positions) are admitted
    assert [pack_rejection(a, p.segment_meta(), lim) for a, p in zip(window.arrays, window.packs)] == [None] * 2
    assert all(a["image_grid_thw"].shape[0] for a in window.arrays)


def test_a_nan_weighted_pack_skips_the_step_leaves_the_weights_and_is_counted(learner):
    before = params(learner)
    a_step(learner, spoil=True)
    after = params(learner)
    assert all(torch_equal(before[n], after[n]) for n in before), "a non-finite step changed the weights"
    assert learner.counters.totals.nonfinite_skipped == 1 and learner.counters.totals.optimizer_updates == 0
    record = json.loads((learner.out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["train/nonfinite_skipped"] == 1 and record["learner/nonfinite_skipped_total"] == 1
    assert record["run_id"] == learner.run_id and len(learner.run_id) == 32

    learner.save()  # what a checkpoint (and, alike, a sync) would carry: the weights before the bad step
    ckpt = learner.out / "checkpoints" / str(learner.step)
    from safetensors.torch import load_file

    saved = load_file(ckpt / "model" / "model.safetensors")
    assert all(bool(t.isfinite().all()) for t in saved.values())
    assert json.loads((ckpt / "trainer_state.json").read_text())["run_id"] == learner.run_id

    a_step(learner, spoil=False)  # the next good step updates as usual
    assert learner.counters.totals.optimizer_updates == 1
    assert any(not torch_equal(after[n], p) for n, p in params(learner).items())


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))



def _fresh_learner(tmp_path, tiny_model_dir, synth_data_dir, overrides=()):
    """A new one-rank learner of the test config (not yet set up): for what the module's shared one has used up."""
    from common.config.load import load_config
    from learner.distributed import Dist
    from learner.rank import Learner
    from learner.run_record import start_run
    from tests.test_learner_harness import write_config

    path = write_config(tmp_path / "cfg.yaml", model_dir=tiny_model_dir, data_dir=synth_data_dir, output_dir=tmp_path / "run",
                        nproc=1, training={"max_steps": 100, "trace_micro_steps": False})
    cfg = load_config(path, list(overrides), world_size=1)
    assert start_run(cfg, 1) is None  # the run record with its run id, as learner/main.py writes it
    return Learner(cfg, Dist("gloo"))


def test_a_frame_cap_below_the_models_largest_legal_pack_is_refused_at_setup_naming_the_key(tmp_path, tiny_model_dir,
                                                                                            synth_data_dir):
    from common.config.load import ConfigError

    # a tiny-model pack of 768 tokens can carry ~3.4 MiB of uint8 pixel_values
    lrn = _fresh_learner(tmp_path, tiny_model_dir, synth_data_dir, ["transport.max_frame_mb=1"])
    try:
        lrn.open_queue()
        with pytest.raises(ConfigError, match=r"transport\.max_frame_mb = 1: .* above the 1 MiB cap"):
            lrn.setup()
    finally:
        lrn.close()


def test_the_learner_time_budget_leaves_the_processs_first_step_out(tmp_path, tiny_model_dir, synth_data_dir):
    """training.max_train_seconds: the first step of a process carries start-up (its sync, CUDA init), not training."""
    lrn = _fresh_learner(tmp_path, tiny_model_dir, synth_data_dir, ["training.max_train_seconds=1000"])
    try:
        lrn.open_queue()
        lrn.setup()
        a_step(lrn, spoil=False)
        assert lrn.step == 1 and lrn.budget.train_seconds == 0.0
        a_step(lrn, spoil=False)
        assert lrn.step == 2 and lrn.budget.train_seconds > 0.0
    finally:
        lrn.close()
