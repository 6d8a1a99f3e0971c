"""The learner's loss: packed-attention isolation on the real tiny Qwen2.5-VL and Qwen3-VL, and the loss math.

Isolation tolerance: fp32 on CPU, loss rtol 1e-5, gradients atol 1e-6 + rtol 1e-4 of the largest
gradient entry (the pack and the one-by-one runs sum the same terms in a different order).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from common.packing.segment import IGNORE_INDEX, Pack, Segment
from learner.loss import (
    LossWeights,
    Normaliser,
    ciou_loss,
    expected_coords,
    pack_loss,
    supervised_rows,
)
from learner.model import block_causal_mask, forward_rows, load_policy, pack_inputs, text_positions

CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module", params=["tiny_model_dir", "tiny_qwen3_model_dir"], ids=["qwen2.5-vl", "qwen3-vl"])
def policy(request):
    """The tiny model of each family: Qwen3-VL adds deepstack vision features and an interleaved mRoPE."""
    torch.manual_seed(0)
    path = request.getfixturevalue(request.param)
    cfg = SimpleNamespace(path=str(path), dtype="float32", attn_implementation="sdpa", coord_tokens=True)
    model, tokenizer, coord_ids = load_policy(cfg, CPU)
    return model, tokenizer, coord_ids


def image_segment(model, tokenizer, coord_ids, seed: int, n_images: int, n_text: int, n_boxes: int) -> Segment:
    """A real segment: prompt text, ``n_images`` images (vision start, pads, end), an answer with coords."""
    rng = np.random.default_rng(seed)
    cfg = model.config
    text_ids = [i for i in range(100, 900)]  # ordinary BPE tokens of the tiny tokenizer
    ids: list[int] = list(rng.choice(text_ids, size=3))
    grids = []
    for _ in range(n_images):
        h, w = (int(x) for x in rng.choice([2, 4], size=2))
        grids.append([1, h, w])
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (h * w // 4) + [cfg.vision_end_token_id]
    prompt_len = len(ids)
    answer = list(rng.choice(text_ids, size=n_text))
    coord_slots = sorted(rng.choice(np.arange(1, n_text), size=4 * n_boxes, replace=False).tolist())
    bins = rng.integers(0, 1000, size=4 * n_boxes)
    for slot, b in zip(coord_slots, bins):
        answer[slot] = coord_ids[int(b)]
    ids += answer
    input_ids = torch.tensor(ids)[None]
    labels = np.full(len(ids), IGNORE_INDEX, np.int64)
    labels[prompt_len:] = ids[prompt_len:]
    coord_pos = np.array([prompt_len + s for s in coord_slots], np.int64)
    labels[coord_pos] = IGNORE_INDEX
    weights = np.where(labels != IGNORE_INDEX, rng.choice([1.0, 0.5], size=len(ids)), 0.0).astype(np.float32)
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    mm = (input_ids == cfg.image_token_id).int()
    if n_images:
        pos, _ = model.model.get_rope_index(input_ids, mm, image_grid_thw=grid)
        position_ids = pos[:, 0].numpy()
    else:
        position_ids = np.tile(np.arange(len(ids)), (3, 1))
    vc = cfg.vision_config
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    n_patches = int(grid.prod(dim=1).sum()) if n_images else 0
    segment = Segment(
        sample_id=f"seg{seed}", channel="B", ver=0,
        input_ids=np.array(ids, np.int64), labels=labels, weights=weights, position_ids=position_ids.astype(np.int64),
        coord_pos=coord_pos, coord_bins=bins.astype(np.int64),
        # uint8 levels ~ N(128, 40) and an affine (u8 - 128) / 40: model inputs ~ N(0, 1), as before lean pixels
        pixel_values=np.clip(np.rint(rng.standard_normal((n_patches, patch_dim)) * 40 + 128), 0, 255).astype(np.uint8),
        image_grid_thw=grid.numpy() if n_images else np.zeros((0, 3), np.int64),
        pixel_affine=np.array([[1 / 40] * patch_dim, [-3.2] * patch_dim], np.float32),
    )
    segment.validate()
    return segment


def run_pack(model, coord_ids, segments, norm, weights=LossWeights()):
    inputs = pack_inputs(Pack(ver=0, channel="B", segments=segments).tensors(), "sdpa", torch.float32, CPU)
    terms = pack_loss(forward_rows(model, inputs), inputs.rows, torch.tensor(coord_ids), norm, weights)
    terms.backward.backward()
    return terms


def grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


# --------------------------------------------------------------------------------------------- isolation


def test_a_packs_loss_and_gradients_equal_the_sum_over_its_segments_run_one_by_one(policy):
    model, tokenizer, coord_ids = policy
    segments = [
        image_segment(model, tokenizer, coord_ids, seed=1, n_images=1, n_text=30, n_boxes=2),
        image_segment(model, tokenizer, coord_ids, seed=2, n_images=2, n_text=24, n_boxes=1),
        image_segment(model, tokenizer, coord_ids, seed=3, n_images=0, n_text=18, n_boxes=1),
    ]
    rows = [supervised_rows(*(torch.from_numpy(getattr(s, k)) for k in ("labels", "coord_pos", "coord_bins", "weights")))
            for s in segments]
    norm = Normaliser(ce_tokens=sum(r.n_ce for r in rows), boxes=sum(r.n_boxes for r in rows))
    model.zero_grad(set_to_none=True)

    packed = run_pack(model, coord_ids, segments, norm)
    g_pack = grads(model)
    alone = [run_pack(model, coord_ids, [s], norm) for s in segments]
    g_alone = grads(model)

    for key in ("total", "ce", "bbox_smoothl1", "bbox_ciou"):
        want = sum(getattr(t, key) for t in alone)
        assert getattr(packed, key) == pytest.approx(want, rel=1e-5), f"{key}: pack {getattr(packed, key)} != Σ {want}"
    assert set(g_pack) == set(g_alone)
    scale = max(float(g.abs().max()) for g in g_pack.values())
    for name, g in g_pack.items():
        torch.testing.assert_close(g, g_alone[name], atol=1e-6 + 1e-4 * scale, rtol=1e-4, msg=f"gradient of {name}")
    assert any(n.startswith("model.visual") for n in g_pack), "the image segments must reach the vision tower"


def test_an_image_less_pack_gives_every_vision_parameter_a_zero_gradient(policy):
    """The zero vision term reaches the whole tower, Qwen3-VL's deepstack mergers included (they are only reached
    through the tower's list of deepstack features); without it DDP would fail the next step."""
    model, tokenizer, coord_ids = policy
    seg = image_segment(model, tokenizer, coord_ids, seed=6, n_images=0, n_text=16, n_boxes=1)
    model.zero_grad(set_to_none=True)
    run_pack(model, coord_ids, [seg], Normaliser(ce_tokens=16, boxes=1))
    vision = {n: p.grad for n, p in model.named_parameters() if n.startswith("model.visual")}
    model.zero_grad(set_to_none=True)
    missing = sorted(n for n, g in vision.items() if g is None)
    assert vision and not missing, f"vision parameters without a gradient: {missing[:5]}"
    assert all(float(g.abs().max()) == 0 for g in vision.values())


def test_without_the_block_mask_segments_would_leak_into_each_other(policy):
    """The isolation test can fail: 3-row mRoPE positions and no mask let segment 2 see segment 1."""
    model, tokenizer, coord_ids = policy
    segments = [image_segment(model, tokenizer, coord_ids, seed=s, n_images=1, n_text=20, n_boxes=1) for s in (4, 5)]
    inputs = pack_inputs(Pack(ver=0, channel="B", segments=segments).tensors(), "sdpa", torch.float32, CPU)
    with torch.no_grad():
        isolated = forward_rows(model, inputs)
        leaky = dict(inputs.model_kwargs, attention_mask=None, position_ids=inputs.model_kwargs["position_ids"][1:])
        out = model(**leaky, logits_to_keep=inputs.rows.all_src, use_cache=False).logits[0]
    assert not torch.allclose(isolated, out, atol=1e-4)


def test_eager_attention_with_the_additive_mask_matches_sdpa_with_the_boolean_one(policy):
    model, tokenizer, coord_ids = policy
    segments = [image_segment(model, tokenizer, coord_ids, seed=s, n_images=1, n_text=16, n_boxes=1) for s in (6, 7)]
    arrays = Pack(ver=0, channel="B", segments=segments).tensors()
    with torch.no_grad():
        sdpa = forward_rows(model, pack_inputs(arrays, "sdpa", torch.float32, CPU))
        model.set_attn_implementation("eager")
        try:
            eager = forward_rows(model, pack_inputs(arrays, "eager", torch.float32, CPU))
        finally:
            model.set_attn_implementation("sdpa")
    torch.testing.assert_close(eager, sdpa, atol=1e-5, rtol=1e-5)


def test_block_causal_mask_and_text_positions_follow_cu_seqlens():
    cu = torch.tensor([0, 2, 5])
    assert text_positions(cu).tolist() == [0, 1, 0, 1, 2]
    mask = block_causal_mask(cu, "sdpa", torch.float32)[0, 0]
    assert mask.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [False, False, True, False, False],
        [False, False, True, True, False],
        [False, False, True, True, True],
    ]
    additive = block_causal_mask(cu, "eager", torch.float32)[0, 0]
    assert ((additive == 0) == mask).all() and additive.min() == torch.finfo(torch.float32).min
    assert block_causal_mask(cu, "flash_attention_2", torch.bfloat16) is None


# --------------------------------------------------------------------------------------------- loss math


def test_ce_is_weighted_per_token_and_divided_by_the_step_token_count():
    vocab = 7
    logits = torch.randn(3, vocab, dtype=torch.float64)
    labels = torch.tensor([-100, 2, 5, 1])  # positions 1..3 are supervised, read from logits 0..2
    weights = torch.tensor([0.0, 1.0, 0.25, 1.0])
    rows = supervised_rows(labels, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), weights)
    assert rows.ce_src.tolist() == [0, 1, 2] and rows.ce_targets.tolist() == [2, 5, 1]
    terms = pack_loss(logits.float(), rows, torch.arange(vocab), Normaliser(ce_tokens=10, boxes=0), LossWeights())
    logp = torch.log_softmax(logits, -1)
    want = -(logp[0, 2] * 1.0 + logp[1, 5] * 0.25 + logp[2, 1] * 1.0) / 10
    assert terms.ce == pytest.approx(float(want), rel=1e-5)
    assert terms.bbox_smoothl1 == 0 and terms.bbox_ciou == 0 and terms.total == pytest.approx(terms.ce)


def test_coord_expectation_decodes_a_peaked_distribution_to_its_bin():
    logits = torch.full((3, 1000), -1e4)
    for row, k in enumerate((0, 500, 999)):
        logits[row, k] = 0.0
    assert expected_coords(logits, 1.0).tolist() == pytest.approx([0.0, 500 / 999, 1.0], abs=1e-6)
    uniform = expected_coords(torch.zeros(1, 1000), 1.0)
    assert float(uniform) == pytest.approx(0.5, abs=1e-6)
    two = torch.full((1, 1000), -1e4)
    two[0, 100] = two[0, 300] = 0.0  # equal mass on bins 100 and 300 -> 200/999
    assert float(expected_coords(two, 1.0)) == pytest.approx(200 / 999, abs=1e-6)


def test_ciou_of_identical_boxes_is_zero_loss_and_grows_with_disagreement():
    boxes = torch.tensor([[0.1, 0.2, 0.5, 0.6], [0.0, 0.0, 1.0, 1.0]])
    assert ciou_loss(boxes, boxes).tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    swapped = boxes[:, [2, 3, 0, 1]]  # corners given in the other order are the same box
    assert ciou_loss(swapped, boxes).tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    near, far = torch.tensor([[0.12, 0.2, 0.52, 0.6]]), torch.tensor([[0.6, 0.7, 0.9, 0.95]])
    assert 0 < float(ciou_loss(near, boxes[:1])) < float(ciou_loss(far, boxes[:1]))
    # disjoint boxes: IoU 0, the centre-distance term keeps the loss above 1
    assert float(ciou_loss(far, boxes[:1])) > 1.0


def test_geometry_terms_are_normalised_per_box_and_vanish_for_perfect_coords():
    bins = torch.tensor([100, 200, 300, 400])
    logits = torch.full((4, 1000), -1e4)
    logits[torch.arange(4), bins] = 0.0
    rows = supervised_rows(
        torch.full((6,), -100), torch.tensor([1, 2, 3, 4]), bins, torch.zeros(6)
    )
    perfect = pack_loss(logits, rows, torch.arange(1000), Normaliser(0, 1), LossWeights())
    assert perfect.bbox_smoothl1 == pytest.approx(0.0, abs=1e-7) and perfect.bbox_ciou == pytest.approx(0.0, abs=1e-5)
    off = torch.zeros(4, 1000)  # every coordinate decodes to 0.5
    terms = pack_loss(off, rows, torch.arange(1000), Normaliser(0, boxes=2), LossWeights(smoothl1=2.0, ciou=0.0))
    gt = bins.float() / 999
    want_sl1 = float((0.5 * (0.5 - gt) ** 2).sum() / (4 * 2))
    assert terms.bbox_smoothl1 == pytest.approx(want_sl1, rel=1e-4)
    assert terms.total == pytest.approx(2.0 * want_sl1, rel=1e-4)


def test_the_backward_loss_carries_the_ddp_scale_and_the_logged_loss_does_not():
    logits = torch.randn(2, 5, requires_grad=True)
    rows = supervised_rows(torch.tensor([-100, 1, 3]), torch.zeros(0, dtype=torch.long),
                           torch.zeros(0, dtype=torch.long), torch.tensor([0.0, 1.0, 1.0]))
    terms = pack_loss(logits, rows, torch.arange(5), Normaliser(ce_tokens=2, boxes=0, scale=4.0), LossWeights())
    assert float(terms.backward.detach()) == pytest.approx(4.0 * terms.total, rel=1e-6)
    assert not math.isnan(terms.total)


# --------------------------------------------------------------------------------------------- DDP, no unused-parameter search


def _ddp_steps(model_dir: str, port: int, zero_term: bool, out: str) -> None:
    """One gloo rank: DDP(find_unused_parameters=False) trains an image-less pack, then an image pack."""
    import json

    import torch.distributed as dist

    import learner.model as lm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if not zero_term:
        lm.zero_vision_term = lambda model: None  # what forward_rows did before: nothing for the vision tower
    torch.manual_seed(0)
    cfg = SimpleNamespace(path=model_dir, dtype="float32", attn_implementation="sdpa", coord_tokens=True)
    # with gradient checkpointing (as the GPU configs train) where the zero term is on
    model, tokenizer, coord_ids = load_policy(cfg, CPU, gradient_checkpointing=zero_term)
    model.train()
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
    result: dict = {"steps": 0}
    try:
        for seed, n_images in ((1, 0), (2, 1), (3, 0)):
            seg = image_segment(model, tokenizer, coord_ids, seed=seed, n_images=n_images, n_text=20, n_boxes=1)
            norm = Normaliser(ce_tokens=20, boxes=1)
            terms = run_pack(ddp, coord_ids, [seg], norm)
            vis = [p.grad for n, p in model.named_parameters() if n.startswith("model.visual")]
            result.setdefault("vision_grads", []).append(
                "none" if any(g is None for g in vis) else ("zero" if all(float(g.abs().max()) == 0 for g in vis)
                                                             else "nonzero"))
            result.setdefault("loss", []).append(float(terms.total))
            model.zero_grad(set_to_none=True)
            result["steps"] += 1
    except RuntimeError as exc:
        result["error"] = str(exc)[:200]
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))


@pytest.mark.parametrize("zero_term", [True, False])
def test_ddp_without_an_unused_parameter_search_trains_packs_without_images(tiny_model_dir, tmp_path, zero_term):
    import json
    import multiprocessing as mp

    from tests.ports import free_port_block

    out = tmp_path / "r.json"
    p = mp.get_context("spawn").Process(target=_ddp_steps, args=(str(tiny_model_dir), free_port_block(1), zero_term,
                                                                 str(out)))
    p.start()
    p.join(timeout=120)
    if p.is_alive():
        p.kill()
        raise AssertionError("the DDP rank did not finish within 120 s")
    r = json.loads(out.read_text())
    if zero_term:  # image-less packs reach every vision parameter with a zero gradient; losses as usual
        assert r["steps"] == 3 and "error" not in r, r
        assert r["vision_grads"] == ["zero", "nonzero", "zero"]
        assert all(math.isfinite(x) for x in r["loss"])
    else:  # the test can fail: without the zero term DDP refuses the step after an image-less pack
        assert r["steps"] == 1 and "finished reduction" in r["error"], r
