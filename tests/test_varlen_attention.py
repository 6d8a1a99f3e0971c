"""``model.attn_implementation: varlen`` (learner/attention.py) on the real tiny Qwen2.5-VL.

On the CPU the registered function runs its reference (one sdpa call per segment), so these tests check the
wiring end to end: transformers hands it the vision tower's image/window boundaries and the LM's text
positions, pack_inputs builds no [T, T] mask, and the packed forward and backward equal the masked-sdpa path.
Tiny random Qwen2-VL and Qwen3-VL models built from code check the same on those families' forwards.
The CUDA kernel (torch's varlen_attn) is compared with sdpa in bf16 by the GPU test at the end.

Tolerance: fp32 on CPU, the same arithmetic in another order: logits atol 1e-5; gradients atol 1e-6 + 5e-4 of
the largest gradient entry (eager and sdpa, both masked, differ by up to 1.4e-4 of it on these packs: the
noise floor of the tiny model's embedding gradient; a segment leak moves the logits by > 1e-4).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.config.load import ConfigError, load_config
from common.packing.segment import Pack
from learner import attention
from learner.loss import LossWeights, Normaliser, pack_loss, supervised_rows
from learner.model import forward_rows, load_policy, pack_inputs
from tests.conftest import REPO_ROOT
from tests.test_loss import grads, image_segment

CPU = torch.device("cpu")


def policy(model_dir, impl: str, dtype: str = "float32", device: torch.device = CPU):
    torch.manual_seed(0)
    cfg = SimpleNamespace(path=str(model_dir), dtype=dtype, attn_implementation=impl, coord_tokens=True)
    return load_policy(cfg, device)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {impl: policy(tiny_model_dir, impl) for impl in ("sdpa", attention.VARLEN)}


def segments(model, tokenizer, coord_ids, seeds=(1, 2, 3)):
    """Three segments: one image, two images (the windowed layer splits 56..112 px images), none."""
    return [image_segment(model, tokenizer, coord_ids, seed=s, n_images=(1, 2, 0)[i % 3], n_text=24, n_boxes=1)
            for i, s in enumerate(seeds)]


def loss_and_grads(model, coord_ids, segs, impl, norm, device=CPU, dtype=torch.float32):
    inputs = pack_inputs(Pack(ver=0, channel="B", segments=segs).tensors(), impl, dtype, device)
    logits = forward_rows(model, inputs)
    terms = pack_loss(logits.float(), inputs.rows, torch.tensor(coord_ids, device=device), norm, LossWeights())
    terms.backward.backward()
    return logits.detach(), terms, grads(model)


def norm_of(segs) -> Normaliser:
    rows = [supervised_rows(*(torch.from_numpy(getattr(s, k)) for k in ("labels", "coord_pos", "coord_bins", "weights")))
            for s in segs]
    return Normaliser(ce_tokens=sum(r.n_ce for r in rows), boxes=sum(r.n_boxes for r in rows))


def test_varlen_packed_logits_and_gradients_equal_the_masked_sdpa_ones(models):
    (sdpa, tokenizer, coord_ids), (varlen, _, _) = models["sdpa"], models[attention.VARLEN]
    varlen.load_state_dict(sdpa.state_dict())
    segs = segments(sdpa, tokenizer, coord_ids)
    norm = norm_of(segs)
    logits_s, terms_s, g_s = loss_and_grads(sdpa, coord_ids, segs, "sdpa", norm)
    logits_v, terms_v, g_v = loss_and_grads(varlen, coord_ids, segs, attention.VARLEN, norm)
    torch.testing.assert_close(logits_v, logits_s, atol=1e-5, rtol=1e-5)
    assert terms_v.total == pytest.approx(terms_s.total, rel=1e-5)
    assert set(g_v) == set(g_s)
    scale = max(float(g.abs().max()) for g in g_s.values())
    for name, g in g_s.items():
        torch.testing.assert_close(g_v[name], g, atol=1e-6 + 5e-4 * scale, rtol=1e-3, msg=f"gradient of {name}")
    assert any(n.startswith("model.visual") for n in g_v), "the image segments must reach the vision tower"


def test_a_varlen_packs_loss_and_gradients_equal_the_sum_over_its_segments_run_one_by_one(models):
    model, tokenizer, coord_ids = models[attention.VARLEN]
    segs = segments(model, tokenizer, coord_ids, seeds=(4, 5, 6))
    norm = norm_of(segs)
    model.zero_grad(set_to_none=True)
    _, packed, g_pack = loss_and_grads(model, coord_ids, segs, attention.VARLEN, norm)
    alone = [loss_and_grads(model, coord_ids, [s], attention.VARLEN, norm) for s in segs]
    for key in ("total", "ce", "bbox_smoothl1", "bbox_ciou"):
        want = sum(getattr(t, key) for _, t, _ in alone)
        assert getattr(packed, key) == pytest.approx(want, rel=1e-5), f"{key}: pack {getattr(packed, key)} != Σ {want}"
    scale = max(float(g.abs().max()) for g in g_pack.values())
    for name, g in g_pack.items():
        want = sum(a[2][name] for a in alone if name in a[2])
        torch.testing.assert_close(g, want, atol=1e-6 + 1e-4 * scale, rtol=1e-4, msg=f"gradient of {name}")


def test_each_layer_makes_one_varlen_call_from_the_segment_boundaries_and_no_mask_is_built(models):
    model, tokenizer, coord_ids = models[attention.VARLEN]
    segs = segments(model, tokenizer, coord_ids)
    arrays = Pack(ver=0, channel="B", segments=segs).tensors()
    inputs = pack_inputs(arrays, attention.VARLEN, torch.float32, CPU)
    assert inputs.model_kwargs["attention_mask"] is None, "varlen must not get a [T, T] mask"
    calls: list[dict] = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        calls.append({"vision": not getattr(module, "is_causal", True), "cu": kwargs.get("cu_seq_lens_q"),
                      "tokens": query.shape[2]})
        return attention.varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(attention.HF_NAME, recording)
    try:
        with torch.no_grad():
            forward_rows(model, inputs)
            packed = list(calls)
            calls.clear()
            # two 112 px images (8 x 8 patches): the tiny tower's 56 px windows cut each into 2 x 2 windows
            vis = model.model.visual
            grid = torch.tensor([[1, 8, 8], [1, 8, 8]])
            vis(torch.randn(128, vis.config.in_channels * vis.config.temporal_patch_size * vis.config.patch_size ** 2),
                grid_thw=grid)
    finally:
        attention.register()
    vision = [c for c in packed if c["vision"]]
    text = [c for c in packed if not c["vision"]]
    assert len(vision) == model.config.vision_config.depth, "one call per vision block, not one per window"
    assert len(text) == model.config.text_config.num_hidden_layers
    n_patches = int(arrays["image_grid_thw"].prod(axis=1).sum())
    assert all(c["tokens"] == n_patches and c["cu"] is not None for c in vision)
    assert all(c["tokens"] == len(arrays["input_ids"]) and c["cu"] is None for c in text), "the LM reads positions"
    assert len(calls) == model.config.vision_config.depth
    windows = sorted(len(c["cu"]) - 1 for c in calls)
    assert windows == [2, 8], f"full attention: one segment per image; windowed: 4 windows per image, got {windows}"


def tiny_family_model(family: str):
    """A random 2-layer Qwen2-VL or Qwen3-VL built from code (the tiny preset is Qwen2.5-VL only)."""
    import transformers as tf

    text = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, rope_parameters={"rope_type": "default", "rope_theta": 10.0,
                                                        "mrope_section": [2, 3, 3]})
    ids = dict(image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)
    if family == "qwen3_vl":
        text.update(head_dim=16)
        text["rope_parameters"]["mrope_interleaved"] = True
        config = tf.Qwen3VLConfig(text_config=text, **ids, vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, out_hidden_size=64,
            num_position_embeddings=64, deepstack_visual_indexes=[0]))
        cls = tf.Qwen3VLForConditionalGeneration
    else:
        config = tf.Qwen2VLConfig(text_config=text, **ids, vision_config=dict(
            depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14))
        cls = tf.Qwen2VLForConditionalGeneration
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation="sdpa").eval(), config


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_qwen2_vl_and_qwen3_vl_packs_give_the_same_logits_under_varlen_as_under_masked_sdpa(family):
    from learner.model import block_causal_mask, text_positions

    model, config = tiny_family_model(family)
    ids, rope, grids = [], [], []
    for seg, (h, w) in enumerate([(4, 4), (4, 8)]):  # two segments, one image each (grid in patches)
        seg_ids = [5 + seg, 6, config.vision_start_token_id, *[config.image_token_id] * (h * w // 4),
                   config.vision_end_token_id, *range(10, 30)]
        t, grid = torch.tensor(seg_ids)[None], torch.tensor([[1, h, w]])
        rope.append(model.model.get_rope_index(t, (t == config.image_token_id).int(), image_grid_thw=grid)[0][:, 0])
        ids += seg_ids
        grids.append(grid)
    cu = torch.tensor([0, rope[0].shape[1], rope[0].shape[1] + rope[1].shape[1]])
    grid = torch.cat(grids)
    kwargs = dict(input_ids=torch.tensor(ids)[None], image_grid_thw=grid, use_cache=False,
                  position_ids=torch.cat([text_positions(cu)[None], torch.cat(rope, dim=1)])[:, None, :],
                  pixel_values=torch.randn(int(grid.prod(dim=1).sum()), 3 * 2 * 14 * 14))
    with torch.no_grad():
        sdpa = model(**kwargs, attention_mask=block_causal_mask(cu, "sdpa", torch.float32)).logits
        attention.apply(model, attention.VARLEN)
        varlen = model(**kwargs, attention_mask=None).logits
        n0 = int(cu[1])  # the second segment alone (its text positions already restart at 0)
        alone = model(input_ids=kwargs["input_ids"][:, n0:], position_ids=kwargs["position_ids"][..., n0:],
                      pixel_values=kwargs["pixel_values"][16:], image_grid_thw=grid[1:], use_cache=False).logits
    torch.testing.assert_close(varlen, sdpa, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(varlen[:, n0:], alone, atol=1e-5, rtol=1e-5, msg="the second segment must not see the first")


def test_segments_are_found_where_the_text_positions_restart_at_zero():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    cu, longest = attention.segments_from_positions(pos, 9, CPU)
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and longest == 4
    assert attention.segments_from_positions(None, 7, CPU)[0].tolist() == [0, 7]
    with pytest.raises(ValueError, match="must start at 0"):
        attention.segments_from_positions(torch.tensor([[3, 4, 0, 1]]), 4, CPU)


def test_varlen_refuses_a_padding_mask_with_the_fix():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attn_implementation: sdpa"):
        attention.varlen_attention_forward(torch.nn.Module(), q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_the_config_accepts_varlen_and_names_the_key_and_the_choices_for_an_unknown_kernel():
    cfg = load_config(REPO_ROOT / "configs" / "demo_cpu.yaml", ["model.attn_implementation=varlen"], world_size=1)
    assert cfg.model.attn_implementation == attention.VARLEN
    with pytest.raises(ConfigError) as err:
        load_config(REPO_ROOT / "configs" / "demo_cpu.yaml", ["model.attn_implementation=flash_varlen"], world_size=1)
    message = str(err.value)
    assert "model.attn_implementation" in message and "'varlen'" in message and "Fix:" in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run `make test-gpu` on a GPU machine")
def test_torch_varlen_kernel_matches_sdpa_in_bf16_on_the_gpu(tiny_model_dir):
    """The CUDA path (torch's varlen_attn) against the masked sdpa path, bf16: logits and gradients."""
    gpu = torch.device("cuda")
    sdpa, tokenizer, coord_ids = policy(tiny_model_dir, "sdpa", "bfloat16", gpu)
    varlen, _, _ = policy(tiny_model_dir, attention.VARLEN, "bfloat16", gpu)
    varlen.load_state_dict(sdpa.state_dict())
    segs = segments(sdpa, tokenizer, coord_ids)
    norm = norm_of(segs)
    logits_s, terms_s, g_s = loss_and_grads(sdpa, coord_ids, segs, "sdpa", norm, gpu, torch.bfloat16)
    logits_v, terms_v, g_v = loss_and_grads(varlen, coord_ids, segs, attention.VARLEN, norm, gpu, torch.bfloat16)
    torch.testing.assert_close(logits_v.float(), logits_s.float(), atol=3e-2, rtol=2e-2)
    assert terms_v.total == pytest.approx(terms_s.total, rel=1e-2)
    scale = max(float(g.float().abs().max()) for g in g_s.values())
    for name, g in g_s.items():
        torch.testing.assert_close(g_v[name].float(), g.float(), atol=2e-2 * scale, rtol=5e-2, msg=f"gradient of {name}")
