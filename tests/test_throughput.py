"""MFU in the step record and the summary (issue 31): 6 × non-embedding LM parameters × tokens/s ÷ the peak,
with N counted on the real tiny model and the peak measured on this device unless the config gives it."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from launcher.summary import format_summary, print_summary
from learner.metrics import metrics_line
from learner.run_counters import Totals
from learner.step_record import RankStats, RunFacts, StepFacts
from learner.throughput import Throughput, mfu, non_embedding_lm_params


def test_n_counts_the_language_model_without_its_embeddings_vision_tower_or_head(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lm = model.model.language_model
    expected = sum(p.numel() for p in lm.parameters()) - lm.embed_tokens.weight.numel()
    assert non_embedding_lm_params(model) == expected
    assert 0 < expected < sum(p.numel() for p in model.parameters())


def test_n_is_the_models_own_under_a_lora_or_dora_adapter(tiny_model_dir):
    """The adapter's tensors (and a ``modules_to_save`` original) are not the model's parameters: N stays put."""
    from transformers import AutoModelForImageTextToText

    from common.config.load import load_config
    from learner.recipe import apply_recipe
    from tests.server_proc import REPO

    before = non_embedding_lm_params(AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32))
    for kind in ("lora", "dora"):
        model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
        cfg = load_config(REPO / "configs/demo_cpu.yaml", [
            f"model.path={tiny_model_dir}", f"model.adapter={{type: {kind}, rank: 4, alpha: 8, "
            "target_modules: all-linear, modules_to_save: [norm]}"], world_size=1)
        apply_recipe(model, cfg.model)
        lm = model.model.language_model
        names = [n for n, _ in lm.named_parameters()]
        assert any("lora_" in n for n in names) and any(".original_module." in n for n in names)
        assert non_embedding_lm_params(model) == before, kind


def test_the_peak_is_measured_here_unless_the_config_gives_it(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cpu = torch.device("cpu")
    given = Throughput.of(model, cpu, torch.float32, world_size=2, configured_peak=989.0)
    assert (given.peak_source, given.entries()["throughput/peak_tflops"]) == ("config", 2 * 989.0)
    measured = Throughput.of(model, cpu, torch.float32, world_size=1, configured_peak=None)
    assert measured.peak_source == "measured" and measured.peak_tflops_per_rank > 0


def _record(tokens: int, step_s: float, throughput: Throughput | None) -> dict:
    stats = RankStats(tokens=tokens, packs=1, time_step=step_s)
    run = RunFacts(global_step=1, parallel="ddp", ver_current=0, b_ratio_realized=0.0, b_ratio_realized_cumulative=0.0,
                   sync_counts={}, totals=Totals(), throughput=throughput)
    return metrics_line(0, [stats], StepFacts(run=run))


def test_the_step_record_states_mfu_from_its_own_tokens_per_second():
    rec = _record(tokens=12000, step_s=0.5, throughput=Throughput(2_775_000_000, 790.0, 1, "measured"))
    assert rec["throughput/tokens_per_s"] == pytest.approx(24000.0)
    assert rec["throughput/mfu"] == pytest.approx(6 * 2.775e9 * 24000 / 790e12)  # ~0.506
    assert rec["throughput/peak_tflops"] == 790.0 and rec["throughput/lm_params_non_embedding"] == 2_775_000_000
    assert "throughput/mfu" not in _record(tokens=12000, step_s=0.5, throughput=None)  # no peak known: no MFU claimed
    assert mfu(1.0, 1, 0.0) == 0.0


def test_the_summary_prints_the_median_tokens_per_second_and_mfu_leaving_the_start_up_step_out(tmp_path, capsys):
    throughput = Throughput(1_000_000_000, 50.0, 2, "measured")  # 100 TFLOP/s over both ranks
    records = [{**_record(tokens=1000, step_s=s, throughput=throughput), "step": i} for i, s in enumerate([20.0, 1.0, 2.0, 4.0])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = print_summary(tmp_path)
    out = capsys.readouterr().out
    tps = statistics.median([1000 / s for s in (1.0, 2.0, 4.0)])  # 500: the 20 s first step is not in it
    assert summary["tokens_per_s_median"] == pytest.approx(tps)
    assert summary["mfu_median"] == pytest.approx(6 * 1e9 * tps / 100e12)
    assert "500 tokens/s median, MFU 3.0 % (of 100 TFLOP/s, measured)" in out
    cpu = format_summary({**summary, "peak_tflops": 0.0743})  # a CPU's measured peak keeps its digits
    assert "(of 0.0743 TFLOP/s, measured)" in cpu
    assert "MFU" not in format_summary({**summary, "mfu_median": None, "tokens_per_s_median": None})
