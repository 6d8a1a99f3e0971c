"""The Qwen3-VL family for ``tools/make_tiny_model.py --family qwen3-vl``: presets, config, image processor.

The tokenizer, chat template, coord tokens and build bookkeeping are the Qwen2.5-VL builder's own
(``tools/make_tiny_model.py``): Qwen3-VL checkpoints use the same Qwen2 BPE tokenizer class and the same
``<|vision_start|><|image_pad|><|vision_end|>`` image layout. What differs, and lives here:

- ``Qwen3VLForConditionalGeneration``: a vision tower with 16-px patches, learned position embeddings
  (``num_position_embeddings``, a square grid interpolated to each image) and *deepstack* mergers that feed
  the features of some vision layers (``deepstack_visual_indexes``) into the first LLM layers; an LLM with
  per-head q/k RMSNorm and an *interleaved* mRoPE (``mrope_section`` over t/h/w, ``mrope_interleaved``).
- The image processor: 16-px patches (32-px merged units) and mean/std 0.5, so the tiny model's
  ``max_pixels = 128*128`` turns a 112-px image into 8x8 patches = 16 image tokens, as for Qwen2.5.

The real presets copy the sizes of the Qwen3-VL Instruct checkpoints (2B, 4B, 8B dense).
"""

from __future__ import annotations

MIN_PIXELS = 64 * 64
MAX_PIXELS = 128 * 128
PATCH_SIZE = 16
PROCESSOR_CLASS = "Qwen3VLProcessor"
ARCHITECTURE = "Qwen3VLForConditionalGeneration"
IMAGE_PROCESSOR_INFO = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": PATCH_SIZE, "merge_size": 2}


def _text(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, head_dim: int) -> dict:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=intermediate, head_dim=head_dim)


def _vision(depth: int, hidden: int, intermediate: int, heads: int, deepstack: list[int], positions: int) -> dict:
    return dict(depth=depth, hidden_size=hidden, intermediate_size=intermediate, num_heads=heads,
                deepstack_visual_indexes=deepstack, num_position_embeddings=positions)


_VISION_SMALL = _vision(24, 1024, 4096, 16, [5, 11, 17], 2304)  # Qwen3-VL-2B and -4B
PRESETS: dict[str, dict] = {
    # One deepstack layer (index 0 of 2), so the tiny model exercises the deepstack path; 8x8 learned positions
    # cover the 8x8-patch images it sees. mRoPE [6, 5, 5] is Qwen3's [24, 20, 20] scaled to head_dim 32, and
    # rope_theta 10 for the reason the Qwen2.5 tiny preset gives (tools/make_tiny_model.py).
    "tiny": dict(text=_text(128, 2, 4, 2, 256, 32), vision=_vision(2, 64, 128, 4, [0], 64), tie=True,
                 dtype="float32", rope_theta=10.0, mrope_section=[6, 5, 5]),
    "2b": dict(text=_text(2048, 28, 16, 8, 6144, 128), vision=_VISION_SMALL, tie=True, dtype="bfloat16"),
    "4b": dict(text=_text(2560, 36, 32, 8, 9728, 128), vision=_VISION_SMALL, tie=True, dtype="bfloat16"),
    "8b": dict(text=_text(4096, 36, 32, 8, 12288, 128), vision=_vision(27, 1152, 4304, 16, [8, 16, 24], 2304),
               tie=False, dtype="bfloat16"),
}


def build_config(preset: str, ids: dict[str, int], rows: int):
    """The ``Qwen3VLConfig`` of ``preset``; ``ids`` maps the special tokens (endoftext, im_end, image/video pad,
    vision start/end) to their ids, ``rows`` is the embedding row count."""
    from transformers import Qwen3VLConfig

    from common.detection.answer import ENDOFTEXT, IM_END, IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START

    spec = PRESETS[preset]
    text = dict(spec["text"])
    text.update(
        vocab_size=rows, max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": spec.get("rope_theta", 5000000.0),
                         "mrope_section": spec.get("mrope_section", [24, 20, 20]), "mrope_interleaved": True},
        bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT],
        tie_word_embeddings=spec["tie"],
    )
    vision = dict(spec["vision"], patch_size=PATCH_SIZE, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                  hidden_act="gelu_pytorch_tanh", out_hidden_size=text["hidden_size"])
    return Qwen3VLConfig(
        text_config=text, vision_config=vision,
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=spec["tie"], architectures=[ARCHITECTURE],
    )


def model_class():
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration


def build_image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    """Qwen3-VL's image processor settings (16-px patches, mean/std 0.5) on the PIL Qwen2-VL processor class,
    the one Qwen3-VL checkpoints name (its fast variant needs torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=PATCH_SIZE, temporal_patch_size=2, merge_size=2,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
