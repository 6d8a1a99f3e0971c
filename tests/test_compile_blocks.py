"""``training.compile: blocks`` (issue 31): every vision block and decoder layer is compiled in place, the packed
forward and its gradients stay the same, and the key is validated. The CPU tests compile with dynamo's
``eager`` backend (the graph capture and the wiring, without inductor's C++ builds); the speed-up is a GPU
figure (docs/benchmarks.md section 20)."""

from __future__ import annotations

import pytest
import torch

from common.config.load import ConfigError, load_config
from learner.blocks import compile_blocks, is_compiled
from tests.conftest import REPO_ROOT
from tests.test_varlen_attention import loss_and_grads, norm_of, policy, segments


def test_every_vision_block_and_decoder_layer_is_compiled_and_the_packed_loss_and_gradients_stay(tiny_model_dir):
    model, tokenizer, coord_ids = policy(tiny_model_dir, "sdpa")
    segs = segments(model, tokenizer, coord_ids)
    norm = norm_of(segs)
    logits, terms, grads = loss_and_grads(model, coord_ids, segs, "sdpa", norm)
    model.zero_grad(set_to_none=True)

    n = compile_blocks(model, backend="eager")
    blocks = [*model.model.visual.blocks, *model.model.language_model.layers]
    assert n == len(blocks) > 0
    assert all(is_compiled(b.forward.fn) for b in blocks)
    torch._dynamo.reset()
    logits_c, terms_c, grads_c = loss_and_grads(model, coord_ids, segs, "sdpa", norm)
    torch.testing.assert_close(logits_c, logits, rtol=1e-5, atol=1e-5)
    assert terms_c.total == pytest.approx(terms.total, rel=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_checkpointed_compiled_blocks_capture_graphs_shared_by_depth_and_run_their_hooks_once(tiny_model_dir):
    # transformers 5.24 checkpoints a layer's forward behind torch.compiler.disable, so Module.compile of a
    # checkpointed layer captured no graph; 5.17 checkpoints __call__, so hooks (FSDP2's all-gather) ran again in
    # the recomputation. learner/blocks.py owns both the checkpoint and the compiled region.
    from torch._dynamo.utils import counters

    from learner.blocks import set_checkpointing

    model, tokenizer, coord_ids = policy(tiny_model_dir, "sdpa")
    segs = segments(model, tokenizer, coord_ids)
    norm = norm_of(segs)
    eager_terms = loss_and_grads(model, coord_ids, segs, "sdpa", norm)[1]
    model.zero_grad(set_to_none=True)
    blocks = [*model.model.visual.blocks, *model.model.language_model.layers]
    assert set_checkpointing(model, 1) == len(blocks)
    calls = {id(b): 0 for b in blocks}
    for b in blocks:
        b.register_forward_pre_hook(lambda m, _args: calls.__setitem__(id(m), calls[id(m)] + 1))
    compile_blocks(model, backend="eager")
    torch._dynamo.reset()
    counters.clear()
    terms = loss_and_grads(model, coord_ids, segs, "sdpa", norm)[1]
    assert terms.total == pytest.approx(eager_terms.total, rel=1e-5)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, "no graph captured: the checkpointed layers ran uncompiled"
    kinds = len({type(b) for b in blocks})
    assert graphs <= 8 * kinds, f"{graphs} graphs for {len(blocks)} layers of {kinds} kinds: not shared by depth"
    assert set(calls.values()) == {1}, "a hook ran again in the recomputation"


def test_a_model_without_blocks_to_compile_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="training.compile: none"):
        compile_blocks(torch.nn.Linear(2, 2))


def test_the_config_takes_none_or_blocks_and_names_the_key_otherwise():
    cfg = load_config(REPO_ROOT / "configs" / "demo_cpu.yaml", ["training.compile=blocks"], world_size=1)
    assert cfg.training.compile == "blocks"
    with pytest.raises(ConfigError) as err:
        load_config(REPO_ROOT / "configs" / "demo_cpu.yaml", ["training.compile=max-autotune"], world_size=1)
    assert "training.compile" in str(err.value) and "'blocks'" in str(err.value)
