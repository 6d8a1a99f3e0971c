"""What the launcher will start, computed from the config alone (``--dry-run`` prints it).

A plan is a list of :class:`ProcessSpec`: argv, environment additions (GPU visibility), the log
file, how readiness is checked, and how often the supervisor may start it again after it died
(``launcher.max_actor_restarts``, ``launcher.max_server_restarts``). Nothing here starts a process of the
run, so the plan can be checked before any GPU is touched: overlapping GPU sets between the server and the
learner are refused, and so is, on a GPU they may share, a learner whose estimated memory does not fit
beside the vLLM server's share (``launcher/gpu_budget.py``, which asks nvidia-smi for the GPU's total).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.config import Config
from launcher.gpu_budget import shared_gpu_refusal


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


def build_plan(cfg: Config, config_path: str, overrides: list[str], log_dir: Path,
               python: str = sys.executable, start_server: bool = True) -> list[ProcessSpec]:
    """Server(s) first, then the learner (it binds the pack sockets), then the actors."""
    srv, lrn = cfg.rollout_server, cfg.learner
    if srv.gpus and lrn.gpus and set(srv.gpus) & set(lrn.gpus) and not lrn.share_gpus_with_server:
        raise PlanError(f"rollout_server.gpus {srv.gpus} and learner.gpus {lrn.gpus} overlap: "
                        "give the server and the learner disjoint GPU sets")
    if srv.engine == "vllm" and not srv.gpus:
        raise PlanError("rollout_server.engine is vllm but rollout_server.gpus is empty: list the server's GPUs")
    if (why := shared_gpu_refusal(cfg)) is not None:  # now, not an out-of-memory error after the server started
        raise PlanError(why)
    world = lrn.nproc_per_node
    common = ["--config", config_path, *overrides]
    specs: list[ProcessSpec] = []
    if start_server:
        url = cfg.rollout_matching.vllm.servers[0].base_url.rstrip("/")
        specs.append(ProcessSpec(
            name="rollout_server", role="server",
            argv=[python, "-m", "rollout_server", *common],
            env=_gpu_env(srv.gpus), log=log_dir / "rollout_server.log", health_url=f"{url}/health",
            max_restarts=max(0, cfg.launcher.max_server_restarts), restart_backoff_s=cfg.launcher.restart_backoff_s,
        ))
    learner_argv = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                    "learner/main.py", *common]
    specs.append(ProcessSpec(name="learner", role="learner", argv=learner_argv,
                             env={**_gpu_env(lrn.gpus), "OMP_NUM_THREADS": "1"} if not lrn.gpus else _gpu_env(lrn.gpus),
                             log=log_dir / "learner.log"))
    for rank in range(world if actors_wanted(cfg) else 0):
        for index in range(cfg.actor.num_actors_per_rank):
            specs.append(ProcessSpec(
                name=f"actor_r{rank}_{index}", role="actor",
                argv=[python, "-m", "actor", "--rank", str(rank), "--index", str(index), *common],
                env={**_gpu_env(None), "OMP_NUM_THREADS": "1"}, log=log_dir / f"actor_r{rank}_{index}.log",
                max_restarts=max(0, cfg.launcher.max_actor_restarts), restart_backoff_s=cfg.launcher.restart_backoff_s,
            ))
    return specs
