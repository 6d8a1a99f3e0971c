"""The ``learner`` config section: ranks, devices, the data-parallel engine (DDP or FSDP2) and multi-node rendezvous.

:class:`Config` (``common/config/schema.py``) holds it as ``learner``; the section's
cross-field rules are :func:`check_learner_rules`, called by :func:`common.config.load._check_rules`.

What this module does not know: torch, or how the learner wraps its model (``learner/parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from common.config.fields import doc


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
    reduce_every_micro_step: bool = doc(
        "With gradient accumulation (GA > 1): reduce-scatter the gradients after every micro-step and accumulate "
        "them sharded, instead of keeping them unsharded on every rank until the last micro-step's reduce-scatter. "
        "Saves the model's size in gradients on each rank (7B in bf16: 16.6 GB; the 2-rank 7b run peaked at 66.0 "
        "GiB a rank with GA 2 against 39.4 with one pack a step, docs/benchmarks.md section 22) for one more "
        "reduce-scatter per micro-step. Always so with cpu_offload. The launcher's estimate counts it.", False)


@dataclass
class LearnerConfig:
    """The torchrun learner."""

    gpus: list[int] | None = doc("GPU ids of the learner (launcher); must not overlap rollout_server.gpus "
                                 "unless share_gpus_with_server; None = the launcher hides every GPU from it (CPU).", None)
    share_gpus_with_server: bool = doc(
        "Allow learner.gpus to overlap rollout_server.gpus: the learner and the rollout server (hf engine, or "
        "vLLM with a low gpu_memory_utilization) share those GPUs, e.g. a one-GPU box. They then compete for "
        "the GPU's memory and compute; NCCL weight sync between two processes on one GPU fails, so use "
        "weight_sync.transport: http. With a vLLM server the launcher refuses, at start, a learner whose "
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
        "Learner nodes (torchrun --nnodes): world size = nnodes × nproc_per_node, global rank r on node "
        "r // nproc_per_node (the launcher of node k starts ranks k·P .. k·P + P − 1 and their actors: "
        "launcher.node_rank). > 1 needs learner.rdzv_endpoint, learner.node_hosts and a training.output_dir "
        "that every learner node mounts at the same path (docs/multinode.md).", 1)
    rdzv_endpoint: str | None = doc(
        "host:port of the rendezvous every learner node joins: a free port on learner node 0, whose torchrun hosts "
        "the TCP store there (torchrun --rdzv_backend static, so rank r is on node r // nproc_per_node; torchrun's "
        "c10d backend ignores --node_rank and orders nodes by address and pid). None = a single node "
        "(torchrun --standalone).", None)
    node_hosts: list[str] | None = doc(
        "Address of each learner node, by node rank (an IP or name of that node's interface): learner rank r binds "
        "its pack and credit sockets on node_hosts[r // nproc_per_node] and the actors feeding it connect there. "
        "A non-loopback address accepts packs from any host that reaches it (docs/multinode.md, Trust). "
        "None = transport.host for every rank (one node).", None)


LOOPBACK = ("127.", "localhost", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, localhost, ::1)."""
    return host.startswith(LOOPBACK)


def host_of(address: str) -> str:
    """The host part of ``10.0.0.1:29400`` or ``http://10.0.0.1:8000/v1`` (``10.0.0.1``)."""
    netloc = address.split("://", 1)[-1].split("/", 1)[0]
    return netloc.rpartition(":")[0] if ":" in netloc and not netloc.endswith("]") else netloc


def check_learner_rules(cfg: Any, problems: Any) -> None:
    """Fail-fast rules of the section. ``problems.add(key, value, why, fix)``.

    Multi-node: every process of every node loads the same YAML, so these rules hold for all of them. The
    launcher's own rule (``learner.nnodes > 1`` needs ``launcher.node_rank``) is in ``launcher/plan.py``: a
    learner or actor started by hand on node k has no use for the launcher's key.
    """
    lrn, node = cfg.learner, cfg.launcher.node_rank
    nnodes = lrn.nnodes if isinstance(lrn.nnodes, int) else 1
    if nnodes < 1:
        problems.add("learner.nnodes", lrn.nnodes, "must be ≥ 1", "set learner.nnodes: 1 for one node")
    if nnodes > 1 and not lrn.rdzv_endpoint:
        problems.add("learner.rdzv_endpoint", lrn.rdzv_endpoint, f"learner.nnodes = {nnodes} needs a rendezvous",
                     "set learner.rdzv_endpoint: <node 0 address>:29400")
    hosts = lrn.node_hosts
    if (nnodes > 1 or hosts is not None) and (hosts is None or len(hosts) != max(nnodes, 1) or not all(hosts)):
        problems.add("learner.node_hosts", hosts, f"needs one address per learner node (learner.nnodes = {nnodes})",
                     "list each learner node's address, node 0 first" + ("" if nnodes > 1 else ", or remove the key"))
    if isinstance(lrn.rdzv_endpoint, str) and not lrn.rdzv_endpoint.rpartition(":")[2].isdigit():
        problems.add("learner.rdzv_endpoint", lrn.rdzv_endpoint, "not host:port", "write it as 10.0.0.1:29400")
    if isinstance(node, int) and not 0 <= node < max(nnodes, 1):
        problems.add("launcher.node_rank", node, f"outside the learner nodes 0..{max(nnodes, 1) - 1} (learner.nnodes)",
                     f"pass launcher.node_rank=<0..{max(nnodes, 1) - 1}> on each node, or raise learner.nnodes")
    if nnodes > 1 and cfg.stage2_ab.channel_b.mode in ("step", "micro"):
        problems.add("learner.nnodes", nnodes, f"stage2_ab.channel_b.mode {cfg.stage2_ab.channel_b.mode} runs on one "
                     "learner process", "use stage2_ab.channel_b.mode: async for several nodes, or learner.nnodes: 1")
    if hosts and nnodes > 1 and not all(is_loopback(str(h)) for h in hosts):
        _check_reachable(cfg, problems)


def _check_reachable(cfg: Any, problems: Any) -> None:
    """Learner nodes on several machines: every address the nodes share must be reachable from the others."""
    rdzv = cfg.learner.rdzv_endpoint
    if isinstance(rdzv, str) and is_loopback(host_of(rdzv)):
        problems.add("learner.rdzv_endpoint", rdzv, "loopback, but learner.node_hosts spans machines: the other "
                     "nodes cannot reach node 0's rendezvous there", "use node 0's address, e.g. "
                     f"{cfg.learner.node_hosts[0]}:{rdzv.rpartition(':')[2]}")
    for i, server in enumerate(cfg.rollout_matching.vllm.servers):
        url = getattr(server, "base_url", None)
        if isinstance(url, str) and is_loopback(host_of(url)):
            problems.add(f"rollout_matching.vllm.servers[{i}].base_url", url, "loopback, but learner.node_hosts spans "
                         "machines: actors on the other nodes (and rank 0, if the server is elsewhere) cannot reach it",
                         "use the server's network address; the server binds rollout_server.host (not 127.0.0.1) "
                         "and then wants rollout_server.auth_token")
