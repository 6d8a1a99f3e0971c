"""Will the learner fit beside a vLLM rollout server on the GPU they share? Asked by launcher/plan.py before any start.

A learner that does not fit would otherwise be an out-of-memory error minutes in: after the server
compiled and captured its CUDA graphs, when the learner's first backward or AdamW step allocates.

When: only where the learner and a vLLM server share a GPU, i.e. ``learner.gpus`` overlaps
``rollout_server.gpus`` (``learner.share_gpus_with_server: true``; otherwise the plan refuses the
overlap). ``learner.gpus: null`` is not sharing: the launcher then hides every GPU from the learner
(``CUDA_VISIBLE_DEVICES=""``, launcher/plan.py), so it trains on the CPU. An hf server has no configured
share (its weights plus generate's cache), so it is not checked.

The estimate for one learner rank, in bytes (P parameters, counted from the safetensors headers of
``model.path``; shapes from its ``config.json``; b bytes per element of ``model.dtype``, ``auto`` = bf16)::

    weights, gradients, AdamW   (P + 3 P_t) b   the learner trains in model.dtype, no fp32 master copy; AdamW's
                                           exp_avg and exp_avg_sq are in the parameter dtype (learner/model.py);
                                           P_t = the parameters that train (all of them, unless model.freeze or
                                           model.adapter say otherwise: launcher/budget_recipe.py)
    DDP buckets                 P_t b      more than one rank: DDP's gradient buckets
    learner.parallel: fsdp (FSDP2, W = nnodes × nproc_per_node ranks; B = the largest block's parameters,
    R = the root's (embeddings, lm_head, norms, the vision tower's patch embedding and merger); p, r = bytes of
    learner.fsdp.param_dtype and reduce_dtype), instead of the three lines above:
      weights, gradients, AdamW  (P + 3 P_t) b / W  the shards; none on the GPU with learner.fsdp.cpu_offload
      unsharded gradients        P_t b     GA > 1 without cpu_offload or reduce_every_micro_step: gradients
                                           accumulate unsharded until the last micro-step's reduce-scatter
                                           (learner/parallel.py grad_sync)
      gathered parameters        (2 B + R) p   the block computing, the one prefetched, and the root (kept
                                           gathered through the step); P p with reshard_after_forward: false
      unsharded block gradients  (B + R) max(p, r)   one block's before its reduce-scatter, the root's to the end
    overlap snapshot            P b        weight_sync.mode overlap: one more copy of the weights
                                           (learner/weight_sync/overlap.py); under FSDP2 it is in rank 0's host
                                           memory (pinned), not counted here
    sync chunk                  bucket_mb  transports other than http pack chunks on the GPU
    activations                 what one packed forward of T = packing_length tokens (one pack per micro-step)
                                keeps for backward, at the step's peak:
      a layer, whole  per token (text) or patch (vision), with h, i its hidden and MLP widths:
                      training.compile: blocks   b (8 h + 3 i)   8 hidden-wide tensors (among them q, K and V
                                                 repeated to the query heads for varlen attention, the attention
                                                 output, the residual stream) and 3 MLP-wide ones (the gate and up
                                                 outputs, one product): the compiled block's partitioner recomputes
                                                 the norms and the SiLU in backward rather than keep them
                      training.compile: none     b (8 h + 4 i) + 8 h   eager also keeps SiLU(gate), and each RMSNorm
                                                 an fp32 copy of its input (4 h bytes, twice)
                      (the widths' multiples are read off the measurements below, not traced tensor by tensor)
                      measured per block (memory allocated after each block's forward, H200, torch 2.11,
                      transformers 5.17, 12000-token packs of 1024-px images, 2026-11-27): compiled 98,900 B a token
                      (3b decoder layer; formula 98,816), 171,250 (7b; 171,008), 41,416 a patch (vision block;
                      41,000); eager 137,392 (137,216), 237,849 (237,568), 58,190 (58,080)
      a layer, checkpointed   b h (its input); gradient_checkpointing_every N checkpoints the layers whose index
                      is a multiple of N, counting the vision blocks first and the decoder layers after them
                      (learner/blocks.py set_checkpointing); the last decoder layer, when checkpointed, is whole
                      again while backward recomputes it (a vision block is recomputed only after the decoder's
                      activations are freed)
      vision          patches = T s merge² (s = image-token share of a pack, below), the vision tower's widths
      inputs          b (2 h T + (6 patch² + 2 h_vision) patches + 4 merge² h_vision s T)   the embeddings, pixel
                      values and patch embedding, the merger's inputs
      loss head       loss_head plain: (1 - s) T V (b + 8)   logits, their fp32 copy and its gradient for every
                                                     text token: an upper bound (only the supervised rows, the
                                                     answers, are projected)
                      loss_head chunked: 4 CHUNK_BYTES   one vocabulary slice's working set (learner/loss.py)
      the peak        with gradient accumulation (GA > 1) the gradients are there all through the forward: the
                      gradients term + all of the above. With one micro-step per optimizer step the gradients
                      are freed at every step (zero_grad(set_to_none=True)) and come back during backward, so
                      the peak is the larger of the forward's end (all of the above, no gradients) and the
                      vision tower's backward (all gradients + the vision tower's activations, one vision block
                      recomputed, the inputs); the activations term is that peak less the gradients term (under
                      FSDP2 the gradient shards: 7b on 2 ranks, 45.3 GiB estimated for 41.0 measured)
      s               image tokens of an image n = max_pixels / (patch × merge)² (data.max_pixels, else the model's
                      preprocessor_config.json, else Qwen2-VL's default 1280 × 28²) over n + IMAGE_TEXT_TOKENS (the
                      prompt and answer beside each image): 1296 / (1296 + 700) = 0.65 at 1008-1024 px. Images
                      smaller than max_pixels hold fewer tokens: the estimate is then on the safe side
      measured against (docs/benchmarks.md sections 20 and 22; tests/test_gpu_budget.py): the 3b learner alone,
                      every layer / every 2nd / none checkpointed: 33.7 / 65.2 / 102.3 GiB estimated, 31.33 /
                      65.19 / 102.23 measured; end to end, 3b beside vLLM 43.7 vs 43.02, 7b 1 + 1 72.0 vs 70.41,
                      7b on 2 FSDP2 ranks beside 2 vLLM replicas 64.6 vs 66.0; the recipes (frozen vision tower,
                      LoRA, DoRA): launcher/budget_recipe.py
    fixed                       1.5 GiB    CUDA context, cuBLAS workspaces, allocator slack (FIXED_BYTES)

The server's share is ``gpu_memory_utilization`` × total (vLLM keeps its weights, activations, KV cache
and, since 0.21, its CUDA graphs inside it) plus, for transports other than http with ``weight_load:
fast``, the fast load's two receive buffers of ~``bucket_mb`` outside it (docs/gpu.md).

Example (configs/gpu/one_gpu.yaml): the 0.5b preset (1.02 B parameters with its 32-layer vision tower) in bf16,
overlap sync, 2048-token packs, no checkpointing, eager, its processor's 112 px images (16 image tokens, s = 0.02):
9.5 GiB of weights, gradients, AdamW and snapshot + 3.1 GiB of activations + 0.5 GiB sync chunk + 1.5 GiB = 14.7 GiB;
an 80 GB H100 (79.6 GiB) at ``gpu_memory_utilization: 0.3`` leaves it 54.8 GiB. A 20 GiB GPU is refused, naming
``gpu_memory_utilization ≤ 0.21`` as one way out; on 18 GiB no share leaves room for both the learner and the
server's weights (the learner must shrink). With Qwen2-VL's default processor (1280 image tokens, s = 0.65) the
same run needs 12.0 GiB of activations, 23.6 GiB in all.

What this module does not know: torch or CUDA (it reads JSON and safetensors headers; the one GPU query is
``nvidia-smi``), or what else runs on the GPU: only the server's configured share is subtracted.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from common.config.schema import Config
from common.data import image_size
from common.model.groups import group_of
from launcher.budget_recipe import Trained, trained

log = logging.getLogger("tandem.launcher")

GIB = 1 << 30
FIXED_BYTES = 3 * GIB // 2
SERVER_FLOOR_BYTES = 2 * GIB  # a vLLM share below its weights + this (activations, CUDA graphs, a little KV cache) is no use
#: learner/loss.py CHUNK_BYTES (this module imports no torch; tests/test_gpu_budget.py checks they agree).
CHUNK_BYTES = 256 * 2**20
#: Text tokens beside each image in a detection pack (system and user prompt + the answer): the section-20 bench's
#: packs held 6 images of 1,296 tokens in ~12,000 tokens, 704 text tokens an image (answers of 1..40 objects).
IMAGE_TEXT_TOKENS = 700
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}  # auto = bf16 on CUDA (learner/model.py)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a model directory (no weights loaded). ``largest_block`` and ``root_params``
    (FSDP2's units: see the module docstring) are 0 where unknown: :meth:`fsdp_units` then estimates them."""

    num_params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    vision_layers: int = 0
    vision_hidden: int = 0
    vision_intermediate: int = 0
    merge: int = 2
    largest_block: int = 0
    root_params: int = 0
    patch: int = 14
    max_pixels: int = 0  # the processor's (preprocessor_config.json); 0 = unknown: Qwen2-VL's default
    vision_params: int = 0  # the vision tower's without its merger(s) (common/model/groups.py); 0 = unknown
    merger_params: int = 0

    def image_tokens(self, max_pixels: int | None = None) -> int:
        """Image tokens of the largest image: ``max_pixels`` (data.max_pixels) or the model's own, over the
        merged patch's area."""
        pixels = max_pixels or self.max_pixels or image_size.DEFAULT_MAX_PIXELS
        return max(1, pixels // (self.patch * self.merge) ** 2)

    def group_params(self) -> tuple[int, int]:
        """(vision tower, merger) parameters: from the headers, else from the shapes (the blocks; a Qwen2.5-VL
        merger: 4 h_v -> 4 h_v -> h)."""
        if self.vision_params or self.merger_params or not self.vision_layers:
            return self.vision_params, self.merger_params
        hv = self.vision_hidden
        return (self.vision_layers * (4 * hv ** 2 + 3 * hv * self.vision_intermediate),
                16 * hv ** 2 + 4 * hv * self.hidden)

    def fsdp_units(self) -> tuple[int, int]:
        """(largest block, root) parameters: from the headers, else from the shapes (MHA, gated MLP: an upper
        bound for a block; the root is what the blocks leave of ``num_params``)."""
        if self.largest_block:
            return self.largest_block, self.root_params
        text = 4 * self.hidden ** 2 + 3 * self.hidden * self.intermediate
        vision = 4 * self.vision_hidden ** 2 + 3 * self.vision_hidden * self.vision_intermediate
        root = self.num_params - self.layers * text - self.vision_layers * vision
        return max(text, vision if self.vision_layers else 0), max(0, root)


_BLOCK = re.compile(r"^((?:.*\.)?(?:layers|blocks)\.\d+)\.")  # a decoder layer or a vision block: one FSDP2 unit


def safetensors_elements(model_dir: Path) -> dict[str, int]:
    """Elements of every tensor of ``model_dir/*.safetensors`` by name, from the headers only. Tied weights are
    stored once, as ``parameters()`` counts them."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    elements: dict[str, int] = {}
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        elements.update((k, math.prod(v["shape"])) for k, v in header.items() if k != "__metadata__")
    return elements


def _summed(elements: dict[str, int], key) -> dict[str, int]:
    """Elements summed by ``key(name)``."""
    out: dict[str, int] = {}
    for name, n in elements.items():
        out[key(name)] = out.get(key(name), 0) + n
    return out


def fsdp_unit(name: str) -> str:
    """A tensor's FSDP2 unit: ``<prefix>.layers.<i>`` / ``<prefix>.blocks.<i>`` for a block, ``""`` for the root."""
    return m.group(1) if (m := _BLOCK.match(name)) else ""


def safetensors_param_count(model_dir: Path) -> int:
    """Elements of every tensor in ``model_dir/*.safetensors`` (headers only)."""
    return sum(safetensors_elements(model_dir).values())


def model_shape(model_dir: str | Path) -> ModelShape:
    """Parameter count and layer shapes of a transformers model directory (Qwen2/2.5-VL or a plain decoder)."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    text = {**cfg, **(cfg.get("text_config") or {})}
    vis = cfg.get("vision_config") or {}
    hidden = int(text["hidden_size"])
    v_hidden = int(vis.get("hidden_size") or vis.get("embed_dim") or 0)
    elements = safetensors_elements(model_dir)
    groups, by_group = _summed(elements, fsdp_unit), _summed(elements, group_of)
    blocks = [n for unit, n in groups.items() if unit]
    pixels = image_size.model_pixels(model_dir)
    return ModelShape(
        num_params=sum(groups.values()), largest_block=max(blocks, default=0), root_params=groups.get("", 0),
        layers=int(text["num_hidden_layers"]), hidden=hidden,
        intermediate=int(text.get("intermediate_size") or 4 * hidden), vocab=int(text["vocab_size"]),
        vision_layers=int(vis.get("depth") or 0) if v_hidden else 0, vision_hidden=v_hidden,
        vision_intermediate=int(vis.get("intermediate_size") or v_hidden * vis.get("mlp_ratio", 4)),
        merge=int(vis.get("spatial_merge_size") or 2), patch=int(vis.get("patch_size") or 14),
        max_pixels=pixels.max_pixels if pixels else 0, vision_params=by_group.get("vision", 0),
        merger_params=by_group.get("merger", 0))


def _layer_bytes(hidden: int, intermediate: int, b: int, compiled: bool) -> int:
    """Bytes a whole decoder/ViT layer keeps per token (patch) for backward (module docstring)."""
    if compiled:
        return b * (8 * hidden + 3 * intermediate)
    return b * (8 * hidden + 4 * intermediate) + 8 * hidden


def _checkpointed(first: int, layers: int, every: int) -> list[bool]:
    """Which of a stack's layers recompute: global index (vision blocks first) a multiple of ``every`` (0: none)."""
    return [bool(every) and i % every == 0 for i in range(first, first + layers)]


def _stack_bytes(n: float, flags: list[bool], per_layer: int, b: int, hidden: int) -> float:
    """One stack's activations at the end of the forward: ``b hidden`` a token for a checkpointed layer, the
    whole ``per_layer`` for the rest."""
    return n * sum(b * hidden if ckpt else per_layer for ckpt in flags)


def image_token_share(cfg: Config, shape: ModelShape) -> float:
    """s of the module docstring: the share of a pack's tokens that are image tokens (0 without a vision tower)."""
    if not shape.vision_layers:
        return 0.0
    n = shape.image_tokens(cfg.data.max_pixels)
    return n / (n + IMAGE_TEXT_TOKENS)


def activation_bytes(cfg: Config, shape: ModelShape, b: int, what: Trained | None = None) -> tuple[float, float]:
    """(at the end of the forward, during the vision tower's backward without the gradients): module docstring;
    ``what``: the recipe's (launcher/budget_recipe.py), computed when not given."""
    what = what or trained(cfg, shape)
    t = cfg.training
    tokens, every = t.global_max_length, (t.gradient_checkpointing_every if t.gradient_checkpointing else 0)
    compiled = t.compile == "blocks"
    share = image_token_share(cfg, shape)
    patches = tokens * share * shape.merge ** 2
    text_layer = _layer_bytes(shape.hidden, shape.intermediate, b, compiled) + b * what.dora_text
    vision_layer = _layer_bytes(shape.vision_hidden, shape.vision_intermediate, b, compiled) + b * what.dora_vision
    v_flags = _checkpointed(0, shape.vision_layers, every)
    t_flags = _checkpointed(shape.vision_layers, shape.layers, every)
    vision = _stack_bytes(patches, v_flags, vision_layer, b, shape.vision_hidden) if what.vision else 0
    text = _stack_bytes(tokens, t_flags, text_layer, b, shape.hidden)
    inputs = b * 2 * shape.hidden * tokens  # the token embeddings
    if what.vision:  # pixel values and the patch embedding
        inputs += b * (6 * shape.patch ** 2 + 2 * shape.vision_hidden) * patches
    if what.merger:  # the merger's inputs, merge² patches an image token
        inputs += b * 4 * shape.merge ** 2 * shape.vision_hidden * share * tokens
    forward_end = (vision + text + inputs + (tokens * text_layer if t_flags and t_flags[-1] else 0)
                   + _logits_bytes(t.loss_head, tokens, shape.vocab, b, share))
    vision_backward = vision + inputs + (patches * vision_layer if what.vision and any(v_flags) else 0)
    return forward_end, vision_backward


def learner_need(cfg: Config, shape: ModelShape) -> dict[str, int]:
    """The learner rank's estimated GPU memory, term by term (bytes)."""
    b = DTYPE_BYTES[cfg.model.dtype]
    p, lrn, what = shape.num_params, cfg.learner, trained(cfg, shape)
    world = lrn.nnodes * lrn.nproc_per_node
    if lrn.parallel == "fsdp":
        terms = _fsdp_terms(cfg, shape, b, world, what.params)
    else:
        terms = {"weights": p * b, "gradients": what.params * b, "AdamW state": 2 * what.params * b}
        if world > 1:
            terms["DDP buckets"] = what.params * b
    if cfg.weight_sync.mode == "overlap" and lrn.parallel != "fsdp":  # FSDP2's snapshot is on the host
        terms["overlap snapshot"] = p * b
    if cfg.weight_sync.transport != "http":
        terms["sync chunk"] = cfg.weight_sync.bucket_mb << 20
    forward_end, vision_backward = activation_bytes(cfg, shape, b, what)
    activations = forward_end
    grads = terms.get("gradients", terms.get("gradients (shard)"))
    if grads is not None and cfg.derived.gradient_accumulation_steps == 1:  # no gradients during the forward
        activations = max(forward_end - grads, vision_backward)
    terms["activations"] = int(activations)
    terms["fixed"] = FIXED_BYTES
    return terms


def _logits_bytes(loss_head: str, tokens: int, vocab: int, b: int, share: float) -> float:
    """The loss head's share of the activations (module docstring). Measured (docs/benchmarks.md section 20, 3b,
    12000 tokens, H100): the chunked head's step peaked 0.8 GiB below the plain head's."""
    if loss_head == "chunked":
        return 4 * CHUNK_BYTES
    return (1 - share) * tokens * vocab * (b + 8)


def _fsdp_terms(cfg: Config, shape: ModelShape, b: int, world: int, trained_params: int) -> dict[str, int]:
    """The training-state terms of an FSDP2 rank (module docstring)."""
    f, p = cfg.learner.fsdp, shape.num_params
    pb = DTYPE_BYTES[f.param_dtype]  # auto = bf16 on CUDA (learner/parallel.py fsdp_dtype)
    rb = DTYPE_BYTES[f.reduce_dtype]
    block, root = shape.fsdp_units()
    terms: dict[str, int] = {}
    if not f.cpu_offload:
        terms.update({"weights (shard)": p * b // world, "gradients (shard)": trained_params * b // world,
                      "AdamW state (shard)": 2 * trained_params * b // world})
        if cfg.derived.gradient_accumulation_steps > 1 and not f.reduce_every_micro_step:
            terms["unsharded gradients"] = trained_params * b
    terms["gathered parameters"] = (2 * block + root) * pb if f.reshard_after_forward else p * pb
    terms["unsharded block gradients"] = (block + root) * max(pb, rb)
    return terms


def server_share(cfg: Config, total: int) -> int:
    """Bytes of the shared GPU the vLLM server holds: its gpu_memory_utilization share + fast-load buffers."""
    srv, sync = cfg.rollout_server, cfg.weight_sync
    buffers = 2 * (sync.bucket_mb << 20) if srv.weight_load == "fast" and sync.transport != "http" else 0
    return int(srv.gpu_memory_utilization * total) + buffers


def shared_gpus(cfg: Config) -> list[int]:
    """GPU ids the learner and a vLLM server both use under the launcher (empty: nothing to check)."""
    srv, lrn = cfg.rollout_server, cfg.learner
    if srv.engine != "vllm" or not srv.gpus or not lrn.gpus:
        return []
    return sorted(set(srv.gpus) & set(lrn.gpus))


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def refusal(cfg: Config, shape: ModelShape, total: int, gpus: list[int]) -> str | None:
    """None when the learner fits beside the server on a GPU of ``total`` bytes; else the message naming the fixes."""
    need = learner_need(cfg, shape)
    needed, server = sum(need.values()), server_share(cfg, total)
    if needed <= total - server:
        return None
    srv, t = cfg.rollout_server, cfg.training
    extra = server - int(srv.gpu_memory_utilization * total)
    max_util = math.floor((total - extra - needed) / total * 100) / 100
    floor = shape.num_params * DTYPE_BYTES[srv.dtype] + SERVER_FLOOR_BYTES
    util_fix = (f"≤ {max_util:.2f} leaves the learner room by this estimate (a smaller KV cache)"
                if max_util * total >= floor else f"no share leaves room for both the learner and the server's weights "
                f"+ {_gib(SERVER_FLOOR_BYTES)} ({_gib(floor)}): shrink the learner (below)")
    states = " + ".join(f"{k} {_gib(v)}" for k, v in need.items() if k not in ("activations", "sync chunk", "fixed"))
    sync = f"; sync chunk {_gib(need['sync chunk'])}" if "sync chunk" in need else ""
    lines = [
        f"the learner does not fit beside the rollout server on shared GPU {gpus} ({_gib(total)}; launcher/gpu_budget.py):",
        f"  server: {_gib(server)} = rollout_server.gpu_memory_utilization {srv.gpu_memory_utilization} × {_gib(total)}"
        + (f" + {_gib(extra)} of fast-load receive buffers" if extra else "") + f", leaving {_gib(total - server)}",
        f"  learner: about {_gib(needed)} = {shape.num_params / 1e9:.2f} B parameters of {cfg.model.path} in "
        f"{cfg.model.dtype}: {states}; activations {_gib(need['activations'])} for one packed forward of "
        f"{t.global_max_length} tokens{sync}; {_gib(need['fixed'])} fixed",
        "Change one of:",
    ]
    ckpt_line, ckpt_fits = None, False
    # at the operating point the one setting that fixes it: then it leads the list
    if not t.gradient_checkpointing or t.gradient_checkpointing_every > 1:
        every_layer = replace(t, gradient_checkpointing=True, gradient_checkpointing_every=1)
        with_ckpt = sum(learner_need(replace(cfg, training=every_layer), shape).values())
        ckpt_fits = with_ckpt <= total - server
        key = ("training.gradient_checkpointing: true" if not t.gradient_checkpointing else
               f"training.gradient_checkpointing_every: 1 (now {t.gradient_checkpointing_every})")
        ckpt_line = (f"  {key} (keeps one activation per layer, recomputes the rest): the "
                     f"learner then needs about {_gib(with_ckpt)}" + (", which fits: this alone is enough" if ckpt_fits
                                                                      else ""))
        if ckpt_fits:
            lines.append(ckpt_line)
    lines += [
        f"  rollout_server.gpu_memory_utilization: now {srv.gpu_memory_utilization}; {util_fix}",
        f"  training.global_max_length: now {t.global_max_length} tokens per packed forward, what the activations scale "
        f"with (training.per_device_train_batch_size, now {t.per_device_train_batch_size}, only fills A packs up to it)",
    ]
    if ckpt_line is not None and not ckpt_fits:
        lines.append(ckpt_line)
    if "overlap snapshot" in need:
        lines.append("  weight_sync.mode: blocking (no snapshot copy of the weights)")
    if cfg.learner.parallel != "fsdp" or not cfg.learner.fsdp.cpu_offload:
        lines.append("  learner.parallel: fsdp with learner.fsdp.cpu_offload: true (weights, gradients and AdamW state "
                     "in host memory; only the blocks computing are on the GPU: configs/gpu/fsdp_7b_1gpu.yaml)")
    lines.append("  model.path: a smaller model (a smaller tools/make_tiny_model.py --preset), or give the learner "
                 "its own GPU (learner.gpus disjoint from rollout_server.gpus)")
    return "\n".join(lines)


def parse_nvidia_smi(text: str) -> dict[int, int]:
    """``index, memory.total`` CSV lines (MiB, no units) -> {GPU id: total bytes}."""
    totals = {}
    for line in text.strip().splitlines():
        index, mib = (s.strip() for s in line.split(","))
        totals[int(index)] = int(float(mib)) << 20
    return totals


def gpu_total_bytes(gpu: int) -> int | None:
    """Total memory of GPU ``gpu`` (an id as in rollout_server.gpus), or None where nvidia-smi cannot say.

    nvidia-smi rather than torch: the launcher must not hold a CUDA context on the GPU it hands to the others."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return parse_nvidia_smi(out).get(gpu)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def shared_gpu_refusal(cfg: Config) -> str | None:
    """Why the learner cannot fit beside the server on a GPU they share (launcher/plan.py raises it), or None: it
    fits, nothing is shared, or the check cannot be made (no nvidia-smi, no model directory yet: logged)."""
    gpus = shared_gpus(cfg)
    if not gpus:
        return None
    totals = [gpu_total_bytes(g) for g in gpus]
    if None in totals:
        log.warning("GPU memory check skipped: nvidia-smi did not report the memory of GPU(s) %s", gpus)
        return None
    try:
        shape = model_shape(cfg.model.path)
    except (OSError, KeyError, ValueError, struct.error) as exc:
        log.warning("GPU memory check skipped: cannot read the shape of model.path %s (%s)", cfg.model.path, exc)
        return None
    total = min(totals)
    if (why := refusal(cfg, shape, total, gpus)) is None:
        log.info("GPU memory check: learner ~%.1f GiB beside the server's %.1f GiB of %.1f GiB on GPU %s",
                 sum(learner_need(cfg, shape).values()) / GIB, server_share(cfg, total) / GIB, total / GIB, gpus)
    return why
