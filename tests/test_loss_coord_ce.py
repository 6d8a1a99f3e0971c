"""The Stage-1 coord CE of ``pack_loss`` (``LossWeights.coord_ce``) and which channel the learner applies it to.

A small synthetic vocabulary (coord ids in the middle, ordinary ids on both sides) so that "full
vocabulary" and "restricted to the coord ids" give different numbers and different gradients.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from learner.loss import NUM_COORD_BINS, LossWeights, Normaliser, Rows, pack_loss

VOCAB = NUM_COORD_BINS + 300
COORD_IDS = torch.arange(100, 100 + NUM_COORD_BINS)  # ids 0..99 and 1100..1299 are ordinary tokens
N_CE, N_BOXES = 5, 2


def make_case(seed: int = 0) -> tuple[torch.Tensor, Rows]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N_CE + 4 * N_BOXES, VOCAB, generator=g) * 3
    rows = Rows(
        ce_src=torch.arange(N_CE),
        ce_targets=torch.randint(0, VOCAB, (N_CE,), generator=g),
        ce_weights=torch.ones(N_CE),
        coord_src=torch.arange(N_CE, N_CE + 4 * N_BOXES),
        coord_bins=torch.tensor([10, 20, 600, 700, 0, 5, 999, 998]),
    )
    return logits, rows


def test_the_coord_ce_term_is_full_vocabulary_cross_entropy_per_coord_slot():
    logits, rows = make_case()
    norm = Normaliser(ce_tokens=N_CE, boxes=N_BOXES + 1)  # other packs of the step hold one more box
    terms = pack_loss(logits, rows, COORD_IDS, norm, LossWeights(coord_ce=1.0))
    coord_rows = logits[N_CE:]
    by_hand = F.cross_entropy(coord_rows, COORD_IDS[rows.coord_bins], reduction="sum") / (4 * norm.boxes)
    assert terms.coord_ce == pytest.approx(float(by_hand), rel=1e-6)
    restricted = F.cross_entropy(coord_rows[:, COORD_IDS], rows.coord_bins, reduction="sum") / (4 * norm.boxes)
    assert terms.coord_ce > float(restricted) + 1e-3, "the softmax must run over the full vocabulary"
    geometry = pack_loss(logits, rows, COORD_IDS, norm, LossWeights())
    assert terms.total == pytest.approx(geometry.total + float(by_hand), rel=1e-6)


def test_the_coord_ce_weight_scales_the_term_in_the_total_and_the_backward():
    logits, rows = make_case(1)
    norm = Normaliser(ce_tokens=N_CE, boxes=N_BOXES, scale=2.0)
    base = pack_loss(logits, rows, COORD_IDS, norm, LossWeights())
    half = pack_loss(logits, rows, COORD_IDS, norm, LossWeights(coord_ce=0.5))
    assert half.total == pytest.approx(base.total + 0.5 * half.coord_ce, rel=1e-6)
    assert float(half.backward) == pytest.approx(2.0 * half.total, rel=1e-6)


def test_coord_ce_zero_leaves_the_total_at_the_stage2_formula_and_reports_zero():
    logits, rows = make_case(2)
    norm = Normaliser(ce_tokens=N_CE, boxes=N_BOXES)
    terms = pack_loss(logits, rows, COORD_IDS, norm, LossWeights(smoothl1=1.0, ciou=1.0, coord_ce=0.0))
    assert terms.coord_ce == 0.0
    assert terms.total == pytest.approx(terms.ce + terms.bbox_smoothl1 + terms.bbox_ciou, rel=1e-6)
    assert terms.bbox_smoothl1 > 0 and terms.bbox_ciou > 0 and terms.ce > 0


def test_the_coord_ce_gradient_reaches_ordinary_vocabulary_logits_at_coord_rows():
    logits, rows = make_case(3)
    norm = Normaliser(ce_tokens=N_CE, boxes=N_BOXES)
    ordinary = torch.ones(VOCAB, dtype=torch.bool)
    ordinary[COORD_IDS] = False
    geometry_only = LossWeights(smoothl1=1.0, ciou=1.0, coord_ce=0.0)

    def coord_row_grad(weights: LossWeights) -> torch.Tensor:
        x = logits.clone().requires_grad_(True)
        pack_loss(x, rows, COORD_IDS, norm, weights).backward.backward()
        return x.grad[N_CE:]

    assert coord_row_grad(geometry_only)[:, ordinary].abs().max() == 0, "geometry reads the coord ids only"
    grad = coord_row_grad(LossWeights(smoothl1=0.0, ciou=0.0, coord_ce=1.0))
    assert (grad[:, ordinary] > 0).all(), "coord CE pushes every ordinary token's logit down at coord slots"
    targets = COORD_IDS[rows.coord_bins]
    assert (grad[torch.arange(4 * N_BOXES), targets] < 0).all(), "and the target coord token's logit up"


def test_a_pack_without_boxes_has_zero_coord_ce_and_stays_finite():
    logits, rows = make_case(4)
    rows = Rows(rows.ce_src, rows.ce_targets, rows.ce_weights, torch.zeros(0, dtype=torch.long),
                torch.zeros(0, dtype=torch.long))
    x = logits[:N_CE].clone().requires_grad_(True)
    terms = pack_loss(x, rows, COORD_IDS, Normaliser(ce_tokens=N_CE, boxes=0), LossWeights(coord_ce=1.0))
    terms.backward.backward()
    assert terms.coord_ce == 0.0 and torch.isfinite(x.grad).all()


def test_the_learner_gives_coord_ce_to_channel_a_packs_only(tmp_path, tiny_model_dir, synth_data_dir, monkeypatch):
    """Learner.forward_backward picks its LossWeights by channel; the model call is replaced by fixed logits."""
    import learner.rank as rank_mod
    from common.config.load import load_config
    from learner.step_record import RankStats
    from tests.test_learner_harness import write_config

    cfg_path = write_config(tmp_path / "cfg.yaml", model_dir=tiny_model_dir, data_dir=synth_data_dir,
                            output_dir=tmp_path / "run", nproc=1, stage2_ab={"coord_ce_weight": 1.0})
    cfg = load_config(cfg_path, world_size=1)
    learner = rank_mod.Learner(cfg, SimpleNamespace(rank=0, world_size=1, is_main=True, device=torch.device("cpu")))
    assert learner.loss_weights["A"].coord_ce == 1.0 and learner.loss_weights["B"].coord_ce == 0.0
    assert learner.loss_weights["A"].smoothl1 == learner.loss_weights["B"].smoothl1

    logits, rows = make_case(5)
    weight = torch.nn.Parameter(torch.ones(()))
    monkeypatch.setattr(rank_mod, "forward_loss", lambda model, inp, coord_ids, norm, weights, loss_head="plain":
                        pack_loss(logits * weight, inp.rows, coord_ids, norm, weights))
    learner.model = torch.nn.Identity()
    learner.calls = {"forward": 0, "backward": 0}
    learner.coord_ids = COORD_IDS
    inp = SimpleNamespace(rows=rows, n_segments=1, n_tokens=64)
    norm = Normaliser(ce_tokens=N_CE, boxes=N_BOXES)
    by_channel = {}
    for channel in ("A", "B"):
        stats = RankStats()
        learner.forward_backward(inp, norm, stats, channel=channel, sync_grads=True)
        by_channel[channel] = stats
    assert by_channel["A"].loss_coord_ce > 0
    assert by_channel["B"].loss_coord_ce == 0.0
    assert by_channel["A"].loss_total == pytest.approx(by_channel["B"].loss_total
                                                       + by_channel["A"].loss_coord_ce, rel=1e-6)
