"""Model FLOPs utilisation (MFU) of the learner: what the step record, the summary and the bench report.

    MFU = 6 × N × tokens/s ÷ peak        N = the language model's parameters without its embeddings,
                                         peak = the device's dense matmul rate × the number of ranks

``6 N`` is the forward + backward matmul FLOPs per token of a dense decoder (attention's own FLOPs and
the vision tower are left out, as in the usual definition, so MFU understates the work done on long
packs and image-heavy ones). The peak is **measured** on the run's own device at start-up
(:func:`matmul_tflops`: the rate a large square matmul reaches in the model's dtype) unless the config
gives one (``training.peak_tflops``, e.g. a datasheet's dense bf16 figure): a measured peak is what the
kernels can reach on this card, clocks and power limits included, so 100 % is attainable in principle.

What this module does not know: steps, ranks or where tokens come from (the caller passes tokens/s).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a model or device is at hand: learner.metrics imports mfu without it
    import torch


#: Tensors a peft adapter adds beside the model's own (learner/recipe.py injects them in place): not part of N,
#: which is the model's, so a run's MFU does not move with the adapter's rank (a LoRA of rank 16 on every linear
#: of a 3b model adds ~1.4 % to N); a ``modules_to_save`` copy is counted once (its original is left out).
ADAPTER_TENSORS = ("lora_", ".original_module.")


def non_embedding_lm_params(model: torch.nn.Module) -> int:
    """Parameters of the language model without its token embeddings (and without the vision tower and the
    LM head, which are not part of the text decoder stack, and without a peft adapter's own tensors). A model
    without a separate ``language_model`` counts every parameter whose name does not hold ``embed`` or
    ``lm_head``."""
    inner = getattr(model, "model", model)
    lm = getattr(inner, "language_model", None)
    named = lm.named_parameters() if lm is not None else model.named_parameters()
    skip = ("embed_tokens",) if lm is not None else ("embed", "lm_head", "visual")
    return sum(p.numel() for n, p in named if not any(k in n for k in skip + ADAPTER_TENSORS))


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """The device's measured dense matmul rate in TFLOP/s: an 8192³ product on a GPU (3 warm-ups, then the
    mean of 10; ~0.1 s on an H100), 1024³ on a CPU (float32 there: what the CPU learner computes in)."""
    import torch

    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12


def mfu(tokens_per_s: float, lm_params: int, peak_tflops: float) -> float:
    """6 × ``lm_params`` × ``tokens_per_s`` ÷ ``peak_tflops`` (all ranks' tokens against all ranks' peak)."""
    return 6 * lm_params * tokens_per_s / (peak_tflops * 1e12) if peak_tflops > 0 else 0.0


@dataclass(frozen=True)
class Throughput:
    """What a step record needs to state MFU: N and the peak of every rank together, and where the peak came from."""

    lm_params: int
    peak_tflops_per_rank: float
    world_size: int
    peak_source: str  # "measured" or "config"

    @classmethod
    def of(cls, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, world_size: int,
           configured_peak: float | None) -> Throughput:
        """Count N on the unsharded model; measure the peak here unless ``configured_peak`` gives it."""
        peak, source = (configured_peak, "config") if configured_peak else (matmul_tflops(device, dtype), "measured")
        return cls(non_embedding_lm_params(model), float(peak), world_size, source)

    @property
    def peak_tflops(self) -> float:
        """Every rank's peak together (what ``throughput/mfu`` divides by)."""
        return self.peak_tflops_per_rank * self.world_size

    def entries(self) -> dict[str, float | int | str]:
        """The step record's ``throughput/*`` inputs of ``throughput/mfu`` (learner/metrics.py metrics_line)."""
        return {"throughput/lm_params_non_embedding": self.lm_params,
                "throughput/peak_tflops": self.peak_tflops,
                "throughput/peak_source": self.peak_source}
