"""Qwen3-VL through the same path as Qwen2.5-VL, on the tiny random Qwen3-VL (``--family qwen3-vl``).

What is Qwen3-VL's own: an image-only processor built without torchvision, the encoder's rope index
(interleaved mRoPE, 16-px patches), a Stage-1 warm start, and an hf rollout server that serves the model,
takes a weight sync exactly (digest) and then decodes greedily as the synced weights do locally. The packed
forward's isolation and the zero vision term run on both families in ``tests/test_loss.py``.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from common.data.records import iter_jsonl
from common.config.load import load_config
from common.data.processor import load_processor
from common.wire.http import InferResponse
from common.packing.encode import Encoder
from tests.conftest import REPO_ROOT
from tests.test_encode import encode_a, full_conversation

TOKEN = "qwen3-token"


@pytest.fixture(scope="module")
def encoder(tiny_qwen3_model_dir, synth_data_dir):
    return Encoder(tiny_qwen3_model_dir, packing_length=4096, image_root=str(synth_data_dir))


@pytest.fixture(scope="module")
def records(synth_data_dir):
    return list(iter_jsonl(synth_data_dir / "train.jsonl"))[:3]


def test_the_tiny_qwen3_vl_is_a_qwen3_vl_directory_with_coord_tokens_and_deepstack(tiny_qwen3_model_dir):
    config = json.loads((tiny_qwen3_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert config["vision_config"]["deepstack_visual_indexes"] == [0]
    assert config["text_config"]["rope_parameters"]["mrope_interleaved"] is True
    build = json.loads((tiny_qwen3_model_dir / "tandem_build.json").read_text())
    assert build["params"]["family"] == "qwen3-vl"
    first, last = build["coord_token_ids"]
    assert last - first == 999


def test_the_processor_loads_without_torchvision_and_expands_a_112_px_image_to_16_tokens(tiny_qwen3_model_dir):
    processor = load_processor(tiny_qwen3_model_dir)
    assert type(processor).__name__ in ("Qwen3VLProcessor", "ImageOnlyQwen3VLProcessor")
    from PIL import Image

    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
                                         add_generation_prompt=True)
    out = processor(text=[text], images=[Image.new("RGB", (112, 112))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 8, 8]]  # 112 px -> 128 px, 16-px patches
    assert int((out["input_ids"] == processor.image_token_id).sum()) == 16
    assert out["pixel_values"].shape == (64, 3 * 2 * 16 * 16)


def test_the_segment_and_its_positions_equal_the_processor_and_the_models_rope_index(encoder, records):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(encoder.model_path).eval()
    for record in records:
        segment, _ = encode_a(encoder, record)
        ref = full_conversation(encoder, record)
        n = segment.length
        np.testing.assert_array_equal(segment.input_ids, ref["input_ids"][0, :n].numpy())
        want, _ = model.model.get_rope_index(
            ref["input_ids"][:, :n], mm_token_type_ids=ref["mm_token_type_ids"][:, :n],
            image_grid_thw=ref["image_grid_thw"], attention_mask=torch.ones(1, n, dtype=torch.long))
        np.testing.assert_array_equal(segment.position_ids, want[:, 0].numpy())
        vision = np.flatnonzero(ref["mm_token_type_ids"][0, :n].numpy())
        assert len({tuple(segment.position_ids[:, k]) for k in vision}) == vision.size  # real 3-D positions


@pytest.mark.slow
def test_a_two_step_warm_start_of_the_tiny_qwen3_vl_changes_its_weights(tiny_qwen3_model_dir, synth_data_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    from learner.warm_start import ensure_warm_start

    cfg = load_config(REPO_ROOT / "configs" / "warm_start_cpu.yaml", [
        f"model.path={tiny_qwen3_model_dir}", f"data.train_jsonl={synth_data_dir / 'train.jsonl'}",
        f"data.val_jsonl={synth_data_dir / 'val.jsonl'}", "training.max_steps=2", "training.warmup_steps=1",
        "training.per_device_train_batch_size=2", "training.progress=false",
        f"training.output_dir={tmp_path / 'unused'}"], world_size=1)
    out, built = ensure_warm_start(cfg, tmp_path / "detector")
    assert built
    new = AutoModelForImageTextToText.from_pretrained(out).state_dict()
    old = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_model_dir).state_dict()
    assert new.keys() == old.keys()
    changed = {k for k in new if not torch.equal(new[k], old[k])}
    assert len(changed) > len(new) // 2, f"only {len(changed)} of {len(new)} tensors changed"
    assert any("deepstack_merger_list" in k for k in changed), "the deepstack mergers must train"


def greedy_request(encoder, record, max_tokens: int) -> dict:
    item = encoder.prompt_for_rollout(record, encoder.image_paths(record), item_id="q3")
    return {"items": [json.loads(item.model_dump_json(exclude_none=True))],
            "sampling": {"max_tokens": max_tokens, "temperature": 0.0}}


def local_greedy(model, encoder, record, max_tokens: int) -> list[int]:
    prompt = encoder.prompt(record, encoder.image_paths(record))
    from PIL import Image

    processor = load_processor(encoder.model_path)
    images = [Image.open(p).convert("RGB") for p in encoder.image_paths(record)]
    inputs = processor.image_processor(images=images, return_tensors="pt")
    ids = torch.from_numpy(prompt["input_ids"])[None]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=torch.from_numpy(
            prompt["mm_token_type_ids"])[None], pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
            max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_an_hf_server_serves_the_tiny_qwen3_vl_and_a_synced_model_decodes_as_the_synced_weights(
        tiny_qwen3_model_dir, encoder, records):
    from transformers import AutoModelForImageTextToText

    from common.weight_sync import weights as W
    from learner.weight_sync.base import cast_stream, plan
    from learner.weight_sync.served import named_weights
    from learner.weight_sync.http import HttpWeightSender
    from tests.server_proc import rollout_server_process

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a model the checkpoint is not: every matrix moved
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    weights = {n: t.detach().clone() for n, t in named_weights(model)}
    assert any("deepstack_merger_list" in n for n in weights)
    record, max_tokens = records[0], 6
    with rollout_server_process(tiny_qwen3_model_dir, [f"rollout_server.auth_token={TOKEN}"]) as srv:
        client = HttpWeightSender(srv.url, auth_token=TOKEN, timeout_s=60, client_id="qwen3-test")
        try:
            session = client.open()
            info = session.info
            session.abort("only the manifest was wanted")
            report = client.push(weights.items(), bucket_bytes=1 << 20)
            r = httpx.get(srv.url + "/sync/digest", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
            r.raise_for_status()
            assert r.json()["ver"] == report.ver
            assert r.json()["digests"] == [W.exact_digest(cast_stream(info, plan(info, weights.items())))]
            r = httpx.post(srv.url + "/infer", json=greedy_request(encoder, record, max_tokens),
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=httpx.Timeout(120.0, connect=5.0))
        finally:
            client.close()
    assert r.status_code == 200, r.text
    out = InferResponse.model_validate_json(r.content).outputs[0]
    assert encoder.check_server_prompt("q3", out.prompt_token_ids, encoder.prompt(record, encoder.image_paths(record))["input_ids"])
    assert len(out.token_ids) > 0
    assert list(out.token_ids) == local_greedy(model, encoder, record, max_tokens)[:len(out.token_ids)]


def test_add_coord_tokens_gives_a_bare_qwen3_vl_the_coord_tokens_and_an_image_forward_still_runs(tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from common.detection.coord_tokens import coord_token_ids, require_coord_tokens
    from tools.add_coord_tokens import add_coord_tokens
    from tools.make_tiny_model import ensure_tiny_model

    bare = ensure_tiny_model(tmp_path / "bare", coord_tokens=False, family="qwen3-vl")
    summary = add_coord_tokens(bare, tmp_path / "fixed")
    processor = load_processor(tmp_path / "fixed")  # the carried processor_config.json still names Qwen3VLProcessor
    ids = require_coord_tokens(processor.tokenizer, tmp_path / "fixed")
    assert (ids[0], ids[-1]) == summary["coord_id_range"]
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "fixed").eval()
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert model.config.get_text_config().vocab_size >= len(processor.tokenizer)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
                                         add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.new("RGB", (112, 112))], return_tensors="pt")
    inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[ids[0], ids[999]]])], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, 2, dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = model(**inputs).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == model.config.get_text_config().vocab_size
    assert coord_token_ids(processor.tokenizer) == ids


# vLLM's Qwen3VLForConditionalGeneration.hf_to_vllm_mapper (the same three prefixes as its Qwen2.5-VL model): the
# vLLM engine pushes HF names into vLLM's own load_weights, which renames them by these prefixes and then fuses
# q/k/v and gate/up of the LLM (packed_modules_mapping); the vision tower's attn.qkv is already fused in HF.
VLLM_QWEN3_VL_PREFIXES = ("model.visual.", "model.language_model.", "lm_head.")


def test_the_vllm_engines_manifest_is_what_the_learner_sends_under_vllms_qwen3_vl_prefixes(tiny_qwen3_model_dir):
    """The vLLM engine builds its manifest from the architecture on ``meta`` (engine._meta_manifest); a sync is
    accepted only if the learner's names and shapes equal it. Checked here without vLLM for Qwen3-VL."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from common.weight_sync import weights as W
    from learner.weight_sync.served import named_weights

    with torch.device("meta"):
        meta = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tiny_qwen3_model_dir))
    manifest, tied = W.manifest_of(meta)
    learner = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_model_dir)
    sent = [(n, list(t.shape)) for n, t in named_weights(learner)]
    assert sorted(sent) == sorted((s.name, s.shape) for s in manifest)
    names = [n for n, _ in sent]
    assert all(n.startswith(VLLM_QWEN3_VL_PREFIXES) for n in names), [n for n in names if not
                                                                    n.startswith(VLLM_QWEN3_VL_PREFIXES)]
    # tied embeddings travel once, as the input embedding (vLLM's Qwen3 LLM ties lm_head to it and skips lm_head.*)
    assert tied == [["model.language_model.embed_tokens.weight", "lm_head.weight"]]
    assert "lm_head.weight" not in names
    for part in ("deepstack_merger_list.0.linear_fc1.weight", "pos_embed.weight", "blocks.0.attn.qkv.weight",
                 "language_model.layers.0.self_attn.q_norm.weight"):
        assert any(n.endswith(part) for n in names), part


def test_a_checkpoint_naming_the_fast_image_processor_as_released_qwen3_vl_ones_loads_image_only(tiny_qwen3_model_dir,
                                                                                                 tmp_path):
    """Released Qwen3-VL checkpoints name ``Qwen2VLImageProcessorFast``; without torchvision transformers' video
    auto-loader then raises a ValueError (not an ImportError), which the fallback must take too."""
    import shutil

    for f in tiny_qwen3_model_dir.iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, tmp_path / f.name)
    pre = json.loads((tmp_path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**pre, "image_processor_type":
                                                                   "Qwen2VLImageProcessorFast"}))
    processor = load_processor(tmp_path)
    reference = load_processor(tiny_qwen3_model_dir)
    from PIL import Image

    image = Image.new("RGB", (112, 80), (200, 30, 60))
    got, want = (p.image_processor(images=[image], return_tensors="pt") for p in (processor, reference))
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    torch.testing.assert_close(got["pixel_values"], want["pixel_values"])
