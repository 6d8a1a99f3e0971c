"""What the training recipe changes in the learner's memory estimate (launcher/gpu_budget.py): which parameters
get gradients and AdamW state, and which activations a frozen vision tower or a DoRA adapter removes or adds.

    model.freeze                  a frozen group keeps its weights only: no gradients, no AdamW state; a frozen
                                  vision tower keeps no activations for backward (nothing in it needs a gradient),
                                  only the merger's inputs while the merger trains
    model.adapter (lora / dora)   gradients and AdamW state for the adapter's tensors (and modules_to_save) only;
                                  the activations stay (the input gradient still flows through every layer)
      adapter tensors             rank × (fan-in + fan-out) per adapted linear, every linear of a block counted as
                                  all-linear adapts it (an upper bound for a shorter target_modules list):
                                  decoder layer 11 h + 3 i (q, k, v, o as h → h; gate, up, down), vision block
                                  9 h_v + 3 i_v (qkv, proj, gate, up, down), merger 12 h_v + h; DoRA adds one
                                  magnitude per output row (5 h + 2 i, 5 h_v + 2 i_v, 4 h_v + h)
      modules_to_save             trained whole: lm_head / embed_tokens (vocab × h each) and the merger counted;
                                  other names are not
      DoRA activations            peft's DoRA keeps the base layer's output and the adapter's for every adapted
                                  linear (its magnitude's gradient): b × 1.4 × the output widths above per token
                                  (patch) of every layer that is not recomputed (1.4, not 2: read off the DoRA
                                  measurement below, every 2nd layer checkpointed; compiled blocks recompute some)

Measured against (docs/benchmarks.md section 20, the 3b learner on an H200, 12000-token packs of 1024-px images,
compile: blocks, one pack a step; tests/test_gpu_budget.py): every / every 2nd / no layer checkpointed, vision
tower frozen 26.5 / 42.3 / 61.4 GiB, LoRA r16 14.7 / 53.7 / 93.6, DoRA r16 16.0 / 88.3 / out of memory at 139.8.

What this module does not know: torch, peft or the parameters themselves (the shape's counts come from the
safetensors headers, grouped by common/model/groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.config.schema import Config

if TYPE_CHECKING:
    from launcher.gpu_budget import ModelShape


#: Output-wide tensors DoRA keeps per adapted linear, in tenths (module docstring: 1.4).
DORA_OUTPUTS = 14


@dataclass(frozen=True)
class Trained:
    """What the recipe trains, as the estimate counts it."""

    params: int  # parameters with a gradient and AdamW state
    vision: bool  # the vision tower keeps activations for backward
    merger: bool  # the merger's inputs are kept for backward
    dora_text: int  # extra output widths DoRA keeps per token of a whole decoder layer (0 without DoRA)
    dora_vision: int  # ... per patch of a whole vision block


def trained(cfg: Config, shape: ModelShape) -> Trained:
    """The recipe's trained parameters and the activation changes (module docstring)."""
    freeze, adapter = set(cfg.model.freeze or ()), cfg.model.adapter
    vision, merger = shape.group_params()
    sizes = {"vision": vision, "merger": merger, "llm": shape.num_params - vision - merger}
    h, i, hv, iv = shape.hidden, shape.intermediate, shape.vision_hidden, shape.vision_intermediate
    has_vision = shape.vision_layers > 0
    if adapter is None:
        return Trained(sum(n for g, n in sizes.items() if g not in freeze), has_vision and "vision" not in freeze,
                       has_vision and "merger" not in freeze, 0, 0)
    dora = adapter.type == "dora"
    fan = {"llm": shape.layers * (11 * h + 3 * i), "vision": shape.vision_layers * (9 * hv + 3 * iv),
           "merger": (12 * hv + h) if has_vision else 0}
    rows = {"llm": shape.layers * (5 * h + 2 * i), "vision": shape.vision_layers * (5 * hv + 2 * iv),
            "merger": (4 * hv + h) if has_vision else 0}
    params = sum(adapter.rank * fan[g] + (rows[g] if dora else 0) for g in fan if g not in freeze)
    for name in adapter.modules_to_save:
        params += (shape.vocab * h if name in ("lm_head", "embed_tokens") else merger if "merger" in name else 0)
    adapted = {g: g not in freeze for g in fan}
    return Trained(params, has_vision and adapted["vision"], has_vision and adapted["merger"],
                   DORA_OUTPUTS * (5 * h + 2 * i) // 10 if dora and adapted["llm"] else 0,
                   DORA_OUTPUTS * (5 * hv + 2 * iv) // 10 if dora and adapted["vision"] else 0)
