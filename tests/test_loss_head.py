"""``training.loss_head: chunked`` against ``plain``: the same loss terms and gradients without ``[N, V]`` logits.

Three levels: :func:`learner.loss.linear_cross_entropy` against torch's cross-entropy; :func:`head_loss`
against :func:`pack_loss` on the same hidden rows and head weight (desc weights, coord CE, zero rows);
and :func:`learner.model.forward_loss` on the real tiny Qwen2.5-VL (tied embeddings): alone, in a real
learner step, and under FSDP2 and DDP on two gloo ranks. The slices are forced small (``chunk_bytes``) so
that slice boundaries fall inside the vocabulary, between targets and through the coord ids. Tolerances:
fp32 on CPU; the slices sum the log-sum-exp and the hidden-state gradient in another order than one
matmul does.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from common.config.learner import FsdpConfig
from learner.loss import (
    IGNORE_INDEX,
    NUM_COORD_BINS,
    LossWeights,
    Normaliser,
    Rows,
    head_loss,
    linear_cross_entropy,
    pack_loss,
    vocab_slice,
)
from tests.spawned_ranks import run_ranks

VOCAB, HIDDEN = NUM_COORD_BINS + 300, 24
COORD_IDS = torch.arange(100, 100 + NUM_COORD_BINS)
TERMS = ("total", "ce", "bbox_smoothl1", "bbox_ciou", "coord_ce")


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = float(b.abs().max()) if b.numel() else 0.0
    torch.testing.assert_close(a, b, atol=1e-6 + 1e-5 * scale, rtol=1e-5, msg=what)


def test_linear_cross_entropy_equals_torchs_cross_entropy_across_slice_boundaries():
    g = torch.Generator().manual_seed(0)
    hidden0, weight0 = torch.randn(9, HIDDEN, generator=g), torch.randn(VOCAB, HIDDEN, generator=g) * 0.3
    targets = torch.tensor([0, VOCAB - 1, 299, 300, 301, IGNORE_INDEX, 650, 1000, IGNORE_INDEX])
    grad_out = torch.rand(9, generator=g)
    h_ref, w_ref = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    ref = F.cross_entropy(h_ref @ w_ref.T, targets, reduction="none")
    (ref * grad_out).sum().backward()
    for chunk_bytes in (None, 4 * 9 * 300, 4 * 9 * 77):  # one slice; slices ending at 300, 600, ...; odd slices
        h, w = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, targets, chunk_bytes=chunk_bytes)
        (loss * grad_out).sum().backward()
        close(loss, ref.detach(), f"loss, chunk_bytes {chunk_bytes}")
        assert (loss[targets == IGNORE_INDEX] == 0).all()
        close(h.grad, h_ref.grad, f"hidden gradient, chunk_bytes {chunk_bytes}")
        close(w.grad, w_ref.grad, f"weight gradient, chunk_bytes {chunk_bytes}")
    assert vocab_slice(9, VOCAB, 4 * 9 * 300) == 300 and vocab_slice(9, VOCAB, None) == VOCAB
    assert vocab_slice(4000, 151936, 256 * 2**20) == 16640, "a multiple of 256 at the operating point"


def make_case(seed: int, n_ce: int, n_boxes: int) -> tuple[torch.Tensor, torch.Tensor, Rows]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_ce + 4 * n_boxes, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.3
    rows = Rows(
        ce_src=torch.arange(n_ce),
        ce_targets=torch.randint(0, VOCAB, (n_ce,), generator=g),
        ce_weights=torch.where(torch.rand(n_ce, generator=g) < 0.5, 0.5, 1.0),  # desc tokens weigh 0.5
        coord_src=torch.arange(n_ce, n_ce + 4 * n_boxes),
        coord_bins=torch.randint(0, NUM_COORD_BINS, (4 * n_boxes,), generator=g),
    )
    return hidden, weight, rows


def both_heads(hidden0, weight0, rows, norm, weights, chunk_bytes):
    """(terms, hidden grad, weight grad) of the plain head on ``hidden @ weight.T`` and of the chunked head."""
    out = {}
    for name in ("plain", "chunked"):
        h, w = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        if name == "plain":
            terms = pack_loss(h @ w.T, rows, COORD_IDS, norm, weights)
        else:
            terms = head_loss(h, w, rows, COORD_IDS, norm, weights, chunk_bytes=chunk_bytes)
        terms.backward.backward()
        out[name] = (terms, h.grad, w.grad)
    return out["plain"], out["chunked"]


@pytest.mark.parametrize("coord_ce", [0.0, 0.7])
def test_the_chunked_head_gives_the_plain_heads_terms_and_gradients(coord_ce):
    hidden, weight, rows = make_case(1, n_ce=11, n_boxes=3)
    norm = Normaliser(ce_tokens=15, boxes=4, scale=2.0)  # other packs of the step hold more
    weights = LossWeights(smoothl1=1.0, ciou=0.5, temperature=0.8, coord_ce=coord_ce)
    # CE rows (11) get slices of 936 columns, coord rows (12) of 858: boundaries inside the coord ids (100..1099)
    (plain, gh, gw), (chunked, ch, cw) = both_heads(hidden, weight, rows, norm, weights, chunk_bytes=4 * 23 * 448)
    for key in TERMS:
        assert getattr(chunked, key) == pytest.approx(getattr(plain, key), rel=1e-5, abs=1e-7), key
    assert plain.ce > 0 and plain.bbox_ciou > 0 and (plain.coord_ce > 0) == (coord_ce > 0)
    assert float(chunked.backward.detach()) == pytest.approx(float(plain.backward.detach()), rel=1e-5)
    close(ch, gh, "hidden gradient")
    close(cw, gw, "head weight gradient")
    assert float(gw[COORD_IDS].abs().sum()) > 0 and float(gw[:100].abs().sum()) > 0


def test_desc_weights_scale_each_rows_ce_in_the_chunked_head_as_in_the_plain_one():
    hidden, weight, rows = make_case(2, n_ce=6, n_boxes=0)
    norm = Normaliser(ce_tokens=6, boxes=0)
    halved = Rows(rows.ce_src, rows.ce_targets, torch.full((6,), 0.5), rows.coord_src, rows.coord_bins)
    full = Rows(rows.ce_src, rows.ce_targets, torch.ones(6), rows.coord_src, rows.coord_bins)
    (p_half, _, _), (c_half, _, _) = both_heads(hidden, weight, halved, norm, LossWeights(), chunk_bytes=4 * 6 * 512)
    (_, _, _), (c_full, _, _) = both_heads(hidden, weight, full, norm, LossWeights(), chunk_bytes=4 * 6 * 512)
    assert c_half.ce == pytest.approx(p_half.ce, rel=1e-5)
    assert c_half.ce == pytest.approx(0.5 * c_full.ce, rel=1e-5)


@pytest.mark.parametrize("n_ce,n_boxes", [(0, 0), (0, 2), (5, 0)])
def test_a_pack_with_nothing_to_supervise_in_a_term_gives_zero_there_and_zero_gradients_in_both_heads(n_ce, n_boxes):
    hidden, weight, rows = make_case(3, n_ce=n_ce, n_boxes=n_boxes)
    norm = Normaliser(ce_tokens=n_ce, boxes=n_boxes)
    (plain, gh, gw), (chunked, ch, cw) = both_heads(hidden, weight, rows, norm, LossWeights(coord_ce=1.0),
                                                    chunk_bytes=4 * 8 * 256)
    for key in TERMS:
        assert getattr(chunked, key) == pytest.approx(getattr(plain, key), rel=1e-5, abs=1e-7), key
    assert (chunked.ce == 0) == (n_ce == 0) and (chunked.bbox_ciou == 0) == (n_boxes == 0)
    assert cw is not None and ch is not None, "the head weight and the rows stay in the graph (DDP needs a gradient)"
    close(ch, gh, "hidden gradient")
    close(cw, gw, "head weight gradient")
    if n_ce == n_boxes == 0:
        assert float(cw.abs().sum()) == 0 and chunked.total == 0


def test_a_model_without_coord_tokens_trains_ce_alone_in_both_heads():
    """model.coord_tokens: false gives the learner ``torch.tensor([])`` (float, empty) as its coord ids."""
    hidden, weight, rows = make_case(5, n_ce=4, n_boxes=0)
    no_coords = torch.tensor([])
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    plain = pack_loss(h @ w.T, rows, no_coords, Normaliser(ce_tokens=4, boxes=0), LossWeights())
    chunked = head_loss(hidden, weight, rows, no_coords, Normaliser(ce_tokens=4, boxes=0), LossWeights())
    assert chunked.ce == pytest.approx(plain.ce, rel=1e-5) and plain.ce > 0 and plain.bbox_ciou == 0


# --------------------------------------------------------------------------------------------- the real model


CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from learner.model import load_policy

    torch.manual_seed(0)
    cfg = SimpleNamespace(path=str(tiny_model_dir), dtype="float32", attn_implementation="sdpa", coord_tokens=True)
    return load_policy(cfg, CPU)


def pack_of(model, tokenizer, coord_ids, seeds, images=(1, 2, 0)):
    from common.packing.segment import Pack
    from learner.model import pack_inputs
    from tests.test_loss import image_segment

    segments = [image_segment(model, tokenizer, coord_ids, seed=s, n_images=n, n_text=24, n_boxes=2)
                for s, n in zip(seeds, images)]
    return pack_inputs(Pack(ver=0, channel="B", segments=segments).tensors(), "sdpa", torch.float32, CPU)


def run_head(model, inputs, coord_ids, norm, weights, loss_head, chunk_bytes=None):
    from learner.model import forward_loss

    model.zero_grad(set_to_none=True)
    terms = forward_loss(model, inputs, coord_ids, norm, weights, loss_head, chunk_bytes=chunk_bytes)
    terms.backward.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return terms, grads


def test_the_chunked_head_on_the_tiny_model_with_tied_embeddings_gives_the_plain_loss_and_gradients(policy):
    model, tokenizer, coord_ids = policy
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "the tiny model ties them"
    coord = torch.tensor(coord_ids)
    inputs = pack_of(model, tokenizer, coord_ids, seeds=(11, 12, 13))
    norm = Normaliser(ce_tokens=inputs.rows.n_ce, boxes=inputs.rows.n_boxes)
    weights = LossWeights(coord_ce=0.5)
    plain, g_plain = run_head(model, inputs, coord, norm, weights, "plain")
    rows = len(inputs.rows.all_src)
    chunked, g_chunked = run_head(model, inputs, coord, norm, weights, "chunked", chunk_bytes=4 * rows * 700)
    for key in TERMS:
        assert getattr(chunked, key) == pytest.approx(getattr(plain, key), rel=1e-5), key
    assert set(g_chunked) == set(g_plain)
    scale = max(float(g.abs().max()) for g in g_plain.values())
    for name, g in g_plain.items():
        torch.testing.assert_close(g_chunked[name], g, atol=1e-6 + 1e-5 * scale, rtol=1e-4, msg=f"gradient of {name}")
    assert any(n.startswith("model.visual") for n in g_plain)


def test_the_chunked_head_of_an_image_less_pack_still_reaches_every_vision_parameter(policy):
    model, tokenizer, coord_ids = policy
    inputs = pack_of(model, tokenizer, coord_ids, seeds=(14,), images=(0,))
    norm = Normaliser(ce_tokens=inputs.rows.n_ce, boxes=inputs.rows.n_boxes)
    _, grads = run_head(model, inputs, torch.tensor(coord_ids), norm, LossWeights(), "chunked")
    vision = [n for n, p in model.named_parameters() if n.startswith("model.visual")]
    assert vision and all(n in grads and float(grads[n].abs().sum()) == 0 for n in vision)


def test_training_loss_head_reaches_the_learner_and_a_bad_value_names_the_key(tmp_path, tiny_model_dir, synth_data_dir,
                                                                             monkeypatch):
    import learner.rank as rank_mod
    from common.config.load import ConfigError, load_config
    from learner.step_record import RankStats
    from tests.test_learner_harness import write_config

    repo = Path(__file__).resolve().parents[1]
    with pytest.raises(ConfigError) as err:
        load_config(repo / "configs/demo_cpu.yaml", ["training.loss_head=liger"])
    assert "training.loss_head = 'liger'" in str(err.value) and "'chunked'" in str(err.value)

    cfg_path = write_config(tmp_path / "cfg.yaml", model_dir=tiny_model_dir, data_dir=synth_data_dir,
                            output_dir=tmp_path / "run", nproc=1, training={"loss_head": "chunked"})
    cfg = load_config(cfg_path, world_size=1)
    learner = rank_mod.Learner(cfg, SimpleNamespace(rank=0, world_size=1, is_main=True, device=CPU))
    heads = []
    hidden, weight, rows = make_case(4, n_ce=5, n_boxes=1)
    hidden_p, weight_p = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def spy(model, inp, coord_ids, norm, weights, loss_head="plain", **kw):  # the model call, replaced by fixed rows
        heads.append(loss_head)
        return head_loss(hidden_p, weight_p, inp.rows, coord_ids, norm, weights)

    monkeypatch.setattr(rank_mod, "forward_loss", spy)
    learner.model = torch.nn.Identity()
    learner.calls = {"forward": 0, "backward": 0}
    learner.coord_ids = COORD_IDS
    inp = SimpleNamespace(rows=rows, n_segments=1, n_tokens=64)
    stats = RankStats()
    seen = learner.forward_backward(inp, Normaliser(ce_tokens=5, boxes=1), stats, channel="B", sync_grads=True)
    assert heads == ["chunked"] and seen["backward"] == 1
    want = pack_loss(hidden @ weight.T, rows, COORD_IDS, Normaliser(ce_tokens=5, boxes=1), learner.loss_weights["B"])
    assert stats.loss_total == pytest.approx(want.total, rel=1e-5)
    assert hidden_p.grad is not None and weight_p.grad is not None


def test_a_real_learner_step_with_the_chunked_head_matches_the_plain_one(tmp_path, tiny_model_dir, synth_data_dir):
    """The learner's own pieces (a Channel-A window of real packs, Learner.forward_backward) under both heads."""
    from learner.step_record import RankStats
    from tests.test_pack_admission import _fresh_learner

    lrn = _fresh_learner(tmp_path, tiny_model_dir, synth_data_dir, ["training.loss_head=chunked"])
    try:
        lrn.open_queue()
        lrn.setup()
        arrays = [dict(a) for a in lrn.take_a_window(RankStats()).arrays]
        inputs = [lrn.inputs(a) for a in arrays]
        norm = lrn.global_normaliser(inputs)
        runs = {}
        for head in ("chunked", "plain"):
            lrn.cfg.training.loss_head = head
            stats = RankStats()
            for inp in inputs:
                seen = lrn.forward_backward(inp, norm, stats, channel="A", sync_grads=True)
                assert seen == {"forward": 1, "backward": 1}
            runs[head] = (stats.loss_total, {n: p.grad.clone() for n, p in lrn.model.named_parameters()
                                                 if p.grad is not None})
            lrn.optimizer_step.optimizer.zero_grad(set_to_none=True)
    finally:
        lrn.close()
    (chunked, g_chunked), (plain, g_plain) = runs["chunked"], runs["plain"]
    assert plain > 0 and chunked == pytest.approx(plain, rel=1e-5)
    assert set(g_chunked) == set(g_plain)
    scale = max(float(g.abs().max()) for g in g_plain.values())
    for name, g in g_plain.items():
        torch.testing.assert_close(g_chunked[name], g, atol=1e-6 + 1e-5 * scale, rtol=1e-4, msg=f"gradient of {name}")


# --------------------------------------------------------------------------------------------- FSDP2


def _fsdp_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    """One of 2 gloo ranks: the tiny model sharded by FSDP2 (root resharded after forward), plain then chunked; then
    the chunked head under DDP."""
    import os

    import torch.distributed as dist

    from learner import parallel
    from learner.model import load_policy

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        model_cfg = SimpleNamespace(path=model_dir, dtype="float32", attn_implementation="sdpa", coord_tokens=True)
        model, tokenizer, coord_ids = load_policy(model_cfg, CPU)
        inputs = pack_of(model, tokenizer, coord_ids, seeds=(21 + rank, 23 + rank), images=(1, 0))
        fsdp_cfg = FsdpConfig(param_dtype="auto")  # the defaults but param_dtype
        wrapped = parallel.wrap(model, SimpleNamespace(parallel="fsdp", fsdp=fsdp_cfg), CPU, 2, rank)
        norm = Normaliser(ce_tokens=60, boxes=4, scale=2.0)
        grads: dict[str, Any] = {}
        for head in ("plain", "chunked", "plain"):  # plain twice: the second proves nothing leaked from chunked
            terms = forward_loss_fsdp(wrapped, inputs, torch.tensor(coord_ids), norm, head)
            terms.backward.backward()
            full = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            grads.setdefault(head, []).append((terms.total, full))
        ddp_model, _, _ = load_policy(model_cfg, CPU)  # the same heads under DDP (gradients all-reduced, averaged)
        ddp = parallel.wrap(ddp_model, SimpleNamespace(parallel="ddp", fsdp=fsdp_cfg), CPU, 2, rank)
        terms = forward_loss_fsdp(ddp, inputs, torch.tensor(coord_ids), norm, "chunked")
        terms.backward.backward()
        grads["ddp_chunked"] = [(terms.total, {n: p.grad.clone() for n, p in ddp_model.named_parameters()})]
        if rank == 0:
            torch.save(grads, Path(out) / "grads.pt")
        result["ok"] = True
    except BaseException:
        result["error"] = traceback.format_exc()[-3000:]
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # skip destroy_process_group: a failed peer may be gone


def forward_loss_fsdp(model, inputs, coord_ids, norm, head):
    from learner.model import forward_loss

    return forward_loss(model, inputs, coord_ids, norm, LossWeights(coord_ce=0.5), head,
                        chunk_bytes=4 * len(inputs.rows.all_src) * 700)


@pytest.mark.slow
def test_the_chunked_head_under_fsdp2_and_ddp_on_two_ranks_gives_the_plain_heads_gradients(tiny_model_dir, tmp_path):
    from tests.ports import free_port_block

    port = free_port_block(1)
    run_ranks(_fsdp_rank, lambda r: (r, port, str(tiny_model_dir), str(tmp_path)), out_dir=tmp_path, deadline_s=120,
              hang_hint="an FSDP2 all-gather of one rank found no partner")
    grads = torch.load(tmp_path / "grads.pt")
    (plain_total, plain), (again_total, again) = grads["plain"]
    [(chunked_total, chunked)] = grads["chunked"]
    assert chunked_total == pytest.approx(plain_total, rel=1e-5) and again_total == plain_total
    head = "lm_head.weight" if "lm_head.weight" in plain else "model.language_model.embed_tokens.weight"
    assert float(plain[head].abs().sum()) > 0
    scale = max(float(g.abs().max()) for g in plain.values())
    for n, g in plain.items():
        torch.testing.assert_close(chunked[n], g, atol=1e-6 + 1e-5 * scale, rtol=1e-4, msg=f"gradient of {n}")
        assert torch.equal(again[n], g), f"{n}: a plain step after a chunked one differs"
    [(_, ddp)] = grads["ddp_chunked"]
    for n, g in plain.items():
        torch.testing.assert_close(ddp[n], g, atol=1e-6 + 1e-5 * scale, rtol=1e-4, msg=f"DDP chunked gradient of {n}")
