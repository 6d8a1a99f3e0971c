"""The ``learner`` config section: ranks, devices, the data-parallel engine (DDP or FSDP2) and multi-node rendezvous.

Split from ``common/config_schema.py`` (which re-exports :class:`LearnerConfig`); the section's
cross-field rules are :func:`check_learner_rules`, called by :func:`common.config._check_rules`.

What this module does not know: torch, or how the learner wraps its model (``learner/parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from common.config_fields import doc


@dataclass
class FsdpConfig:
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) options, read when ``learner.parallel: fsdp``."""

    param_dtype: Literal["auto", "bfloat16", "float32"] = doc(
        "dtype of the gathered parameters in forward and backward (MixedPrecisionPolicy.param_dtype); the sharded "
        "parameters and the AdamW state keep model.dtype. auto = bfloat16 on CUDA, float32 on CPU.", "auto")
    reduce_dtype: Literal["float32", "bfloat16"] = doc(
        "dtype of the gradient reduce-scatter (MixedPrecisionPolicy.reduce_dtype).", "float32")
    reshard_after_forward: bool = doc(
        "Free each block's gathered parameters after its forward and gather them again for backward (ZeRO-3); "
        "false keeps them until backward (ZeRO-2: more memory, one all-gather less per block).", True)
    cpu_offload: bool = doc(
        "Keep the sharded parameters, gradients and AdamW state in host memory and run the optimizer step on the "
        "CPU (FSDP2 CPUOffloadPolicy): a 7B full fine-tune fits one 80 GB GPU beside a vLLM server. Costs host "
        "memory (~8 bytes per parameter in bf16) and step time (the CPU AdamW step, host-device copies).", False)


@dataclass
class LearnerConfig:
    """The torchrun learner."""

    gpus: list[int] | None = doc("GPU ids of the learner (launcher); must not overlap rollout_server.gpus "
                                 "unless share_gpus_with_server; None = the launcher hides every GPU from it (CPU).", None)
    share_gpus_with_server: bool = doc(
        "Allow learner.gpus to overlap rollout_server.gpus: the learner and the rollout server (hf engine, or "
        "vLLM with a low gpu_memory_utilization) share those GPUs, e.g. a one-GPU box. They then compete for "
        "the GPU's memory and compute; NCCL weight sync between two processes on one GPU fails, so use "
        "rollout_matching.vllm.sync.transport: http. With a vLLM server the launcher refuses, at start, a learner whose "
        "estimated memory does not fit beside the server's gpu_memory_utilization share (launcher/gpu_budget.py).",
        False,
    )
    nproc_per_node: int = doc("Learner ranks started by the launcher on each learner node.", 1)
    backend: Literal["auto", "gloo", "nccl"] = doc("torch.distributed backend; auto = nccl on CUDA else gloo.", "auto")
    collective_timeout_s: float = doc("Deadline for barriers/collectives; a timeout names the awaited step.", 600.0)
    pack_wait_s: float = doc(
        "When the policy wants B but a rank holds fewer than GA eligible packs, re-check for up to this long "
        "before falling back to A (counted in time/wait_for_packs). 0 = never wait: fall back at once.",
        0.0,
    )
    parallel: Literal["ddp", "fsdp"] = doc(
        "Data-parallel engine: ddp (every rank holds the whole model, its gradients and AdamW state) or fsdp "
        "(FSDP2: parameters, gradients and optimizer state sharded over the ranks, each block gathered just in "
        "time; see learner.fsdp). The step contract is the same: one packed forward/backward per micro-step, "
        "gradients reduced on the last. Checkpoints of an fsdp run are sharded (torch.distributed.checkpoint).",
        "ddp",
    )
    fsdp: FsdpConfig = doc("FSDP2 options (learner.parallel: fsdp).", factory=FsdpConfig)
    nnodes: int = doc(
        "Learner nodes (torchrun --nnodes): world size = nnodes × nproc_per_node, rank r on node "
        "r // nproc_per_node. > 1 needs learner.rdzv_endpoint and learner.node_hosts.", 1)
    rdzv_endpoint: str | None = doc(
        "host:port of the c10d rendezvous every learner node joins (a free port on learner node 0, reachable from "
        "every node). None = a single node (torchrun --standalone).", None)
    node_hosts: list[str] | None = doc(
        "Address of each learner node, by node rank: the actors feeding rank r connect to node_hosts[r // "
        "nproc_per_node] for its pack and credit sockets. None = transport.host for every rank (one node).", None)


def check_learner_rules(cfg: Any, problems: Any) -> None:
    """Fail-fast rules of the section. ``problems.add(key, value, why, fix)``."""
    lrn = cfg.learner
    if isinstance(lrn.nnodes, int) and lrn.nnodes < 1:
        problems.add("learner.nnodes", lrn.nnodes, "must be ≥ 1", "set learner.nnodes: 1 for one node")
    if isinstance(lrn.nnodes, int) and lrn.nnodes > 1:
        if not lrn.rdzv_endpoint:
            problems.add("learner.rdzv_endpoint", lrn.rdzv_endpoint, f"learner.nnodes = {lrn.nnodes} needs a rendezvous",
                         "set learner.rdzv_endpoint: <node 0 address>:29400")
        if lrn.node_hosts is None or len(lrn.node_hosts) != lrn.nnodes:
            problems.add("learner.node_hosts", lrn.node_hosts, f"needs one address per learner node ({lrn.nnodes})",
                         "list each learner node's address, node 0 first")
    if isinstance(lrn.rdzv_endpoint, str) and not lrn.rdzv_endpoint.rpartition(":")[2].isdigit():
        problems.add("learner.rdzv_endpoint", lrn.rdzv_endpoint, "not host:port", "write it as 10.0.0.1:29400")
