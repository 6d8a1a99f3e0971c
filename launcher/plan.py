"""What the launcher will start, computed from the config alone (``--dry-run`` prints it).

A plan is a list of :class:`ProcessSpec`: argv, environment additions (GPU visibility), the log
file, how readiness is checked, and how often the supervisor may start it again after it died
(``launcher.max_actor_restarts``, ``launcher.max_server_restarts``). Nothing here starts a process of the
run, so the plan can be checked before any GPU is touched: overlapping GPU sets between the server and the
learner are refused, and so is, on a GPU they may share, a learner whose estimated memory does not fit
beside the vLLM server's share (``launcher/gpu_budget.py``, which asks nvidia-smi for the GPU's total).

Several learner nodes (``learner.nnodes`` = N, ``launcher.node_rank`` = k, P = ``learner.nproc_per_node``):
each node's launcher plans only its share, and node 0 alone starts the rollout server (the other nodes
reach it by ``rollout_matching.vllm.servers``)::

    node 0: rollout_server, torchrun --nnodes N --node_rank 0 (ranks 0..P-1, hosts the rendezvous), their actors
    node k: torchrun --nnodes N --node_rank k (ranks kP..kP+P-1), their actors

torchrun runs the static rendezvous at ``learner.rdzv_endpoint`` (node 0's TCP store), which keeps global
rank r on node r // P: the actors of node k and the pack addresses (``common/wire/transport.py``) rely on it.
torchrun's c10d backend would not: it ignores ``--node_rank`` and orders the nodes by address and pid.
"""

from __future__ import annotations

import hashlib
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.config.schema import Config
from common.config.learner import is_loopback
from launcher.gpu_budget import shared_gpu_refusal


#: torchrun takes a script; an absolute one, so `tandem launch` works from any directory (the processes inherit
#: the caller's cwd, against which the config's own relative paths resolve, as for every other entry point).
LEARNER_SCRIPT = str(Path(__file__).resolve().parents[1] / "learner" / "main.py")


class PlanError(ValueError):
    """The config describes a topology that cannot run on this machine."""


@dataclass
class ProcessSpec:
    name: str  # unique, used for the log file and messages
    role: str  # server | actor | learner
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log: Path | None = None
    health_url: str | None = None  # HTTP URL that answers 200 once ready (server)
    max_restarts: int = 0  # times the supervisor starts it again after it died (actors: exit ≠ 0); 0 = final
    restart_backoff_s: float = 2.0  # pause before the first restart, doubled for each further one (≤ 60 s)

    def shell(self) -> str:
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (envs + " " if envs else "") + " ".join(shlex.quote(a) for a in self.argv)


def _gpu_env(gpus: list[int] | None) -> dict[str, str]:
    # Actors and CPU runs see no GPU at all; otherwise each role sees only its own set.
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus) if gpus else ""}


def actors_wanted(cfg: Config) -> bool:
    """Actor processes feed only the async mode's per-rank queues; ``step`` and ``micro`` roll out inside
    the learner, so actors there would wait for credits no learner publishes and exit with code 3. With
    ``b_ratio: 0`` no step ever wants B: actors would only take the cores (and the server) from the learner."""
    return cfg.stage2_ab.channel_b.mode == "async" and cfg.stage2_ab.schedule.b_ratio > 0


def node_of(cfg: Config) -> int | None:
    """The learner node this launcher starts (``launcher.node_rank``); None = the whole single-node topology."""
    return cfg.launcher.node_rank


def node_log_dir(cfg: Config) -> Path:
    """``{output_dir}/logs``, or ``{output_dir}/logs/node{k}`` for node k of several (output_dir is shared)."""
    out = Path(cfg.training.output_dir) / "logs"
    return out if cfg.learner.nnodes == 1 else out / f"node{node_of(cfg) or 0}"


def record_path(cfg: Config) -> Path:
    """Where the launcher records its processes: ``processes.json``, ``processes_node{k}.json`` on node k of several."""
    name = "processes.json" if cfg.learner.nnodes == 1 else f"processes_node{node_of(cfg) or 0}.json"
    return Path(cfg.training.output_dir) / name


def rdzv_id(cfg: Config) -> str:
    """The rendezvous id every node derives alike from the shared config: a node started with another
    ``training.output_dir`` (another run) never joins this one."""
    key = f"{cfg.training.output_dir}|{cfg.learner.rdzv_endpoint}|{cfg.learner.nnodes}"
    return "tandem-" + hashlib.sha1(key.encode()).hexdigest()[:12]


def torchrun_args(cfg: Config) -> list[str]:
    """torchrun's placement flags: ``--standalone`` on one node, else this node of a static rendezvous."""
    lrn = cfg.learner
    if lrn.rdzv_endpoint is None:
        return ["--standalone", f"--nproc_per_node={lrn.nproc_per_node}"]
    node = node_of(cfg) or 0
    # timeout: how long node k's torchrun waits for every node to reach node 0's store (static rendezvous)
    return [f"--nnodes={lrn.nnodes}", f"--node_rank={node}", f"--nproc_per_node={lrn.nproc_per_node}",
            "--rdzv_backend=static", f"--rdzv_endpoint={lrn.rdzv_endpoint}", f"--rdzv_id={rdzv_id(cfg)}",
            f"--rdzv_conf=timeout={int(lrn.collective_timeout_s)}"]


def node_ranks(cfg: Config) -> range:
    """The global learner ranks on this launcher's node."""
    per = cfg.learner.nproc_per_node
    return range((node_of(cfg) or 0) * per, ((node_of(cfg) or 0) + 1) * per)


def node_refusal(cfg: Config, start_server: bool) -> str | None:
    """Why this node's share cannot start as configured (the launcher's own rules), or None."""
    lrn, node = cfg.learner, node_of(cfg)
    if lrn.nnodes > 1 and node is None:
        return (f"learner.nnodes = {lrn.nnodes}: this launcher starts one learner node's share. Fix: run "
                f"`python -m launcher --config C launcher.node_rank=k` on each node k = 0..{lrn.nnodes - 1} "
                "(node 0 first: it hosts the rendezvous and the rollout server)")
    remote = lrn.nnodes > 1 and any(not is_loopback(h) for h in lrn.node_hosts or [])
    if remote and start_server and node == 0 and is_loopback(cfg.rollout_server.host):
        return (f"rollout_server.host = {cfg.rollout_server.host!r}: the server node 0 starts would answer only "
                "node 0, but learner.node_hosts spans machines (the actors of the other nodes call it). Fix: set "
                "rollout_server.host to node 0's address (or 0.0.0.0) and rollout_server.auth_token")
    return None


def build_plan(cfg: Config, config_path: str, overrides: list[str], log_dir: Path,
               python: str = sys.executable, start_server: bool = True) -> list[ProcessSpec]:
    """Server(s) first, then the learner (it binds the pack sockets), then the actors: this node's share."""
    srv, lrn = cfg.rollout_server, cfg.learner
    if srv.gpus and lrn.gpus and set(srv.gpus) & set(lrn.gpus) and not lrn.share_gpus_with_server:
        raise PlanError(f"rollout_server.gpus {srv.gpus} and learner.gpus {lrn.gpus} overlap: "
                        "give the server and the learner disjoint GPU sets")
    if srv.engine == "vllm" and not srv.gpus and start_server and not node_of(cfg):
        raise PlanError("rollout_server.engine is vllm but rollout_server.gpus is empty: list the server's GPUs")
    if (why := node_refusal(cfg, start_server) or shared_gpu_refusal(cfg)) is not None:  # now, not an OOM later
        raise PlanError(why)
    common = ["--config", str(Path(config_path).resolve()), *overrides]
    specs: list[ProcessSpec] = []
    if start_server and not node_of(cfg):  # node 0 (or the only node) starts the server; the others call it
        url = cfg.rollout_matching.vllm.servers[0].base_url.rstrip("/")
        specs.append(ProcessSpec(
            name="rollout_server", role="server",
            argv=[python, "-m", "rollout_server", *common],
            env=_gpu_env(srv.gpus), log=log_dir / "rollout_server.log", health_url=f"{url}/health",
            max_restarts=max(0, cfg.launcher.max_server_restarts), restart_backoff_s=cfg.launcher.restart_backoff_s,
        ))
    learner_argv = [python, "-m", "torch.distributed.run", *torchrun_args(cfg), LEARNER_SCRIPT, *common]
    specs.append(ProcessSpec(name="learner", role="learner", argv=learner_argv,
                             env={**_gpu_env(lrn.gpus), "OMP_NUM_THREADS": "1"} if not lrn.gpus else _gpu_env(lrn.gpus),
                             log=log_dir / "learner.log"))
    for rank in node_ranks(cfg) if actors_wanted(cfg) else []:
        for index in range(cfg.actor.num_actors_per_rank):
            specs.append(ProcessSpec(
                name=f"actor_r{rank}_{index}", role="actor",
                argv=[python, "-m", "actor", "--rank", str(rank), "--index", str(index), *common],
                env={**_gpu_env(None), "OMP_NUM_THREADS": "1"}, log=log_dir / f"actor_r{rank}_{index}.log",
                max_restarts=max(0, cfg.launcher.max_actor_restarts), restart_backoff_s=cfg.launcher.restart_backoff_s,
            ))
    return specs
