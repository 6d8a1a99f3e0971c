"""Render a docker compose file: ``python -m launcher.compose --config C [--profile gpu|cpu] [--node-rank k]``.

The committed ``deploy/docker-compose.yml`` (GPU topology of ``configs/stage2_ab/async.yaml``) and
``deploy/docker-compose.cpu.yml`` (the ``make demo`` topology) are produced by this module, and a
test checks they still agree with their configs: services, commands, GPU sets, ports.

With ``learner.nnodes`` > 1, ``--node-rank k`` renders learner node k's file, the same share the launcher
starts there (``launcher/plan.py``): node 0 the rollout server, torchrun for ranks 0..P-1 (it hosts the
rendezvous) and their actors; node k torchrun for its ranks and their actors. Run one file per node
(docs/multinode.md). Dotted overrides after the flags go into every service's command.
"""

from __future__ import annotations

import copy
import shlex
import sys
from typing import Any

import yaml

from common.runs import cli
from common.config.schema import Config
from launcher.plan import actors_wanted, node_of, node_ranks, node_refusal, torchrun_args

IMAGE = {"gpu": "tandem:gpu-vllm0.26.0", "cpu": "tandem:cpu"}
DOCKERFILE = {"gpu": "deploy/Dockerfile.gpu", "cpu": "deploy/Dockerfile.cpu"}


def _gpus(ids: list[int] | None) -> dict[str, Any]:
    if not ids:
        return {}
    return {"deploy": {"resources": {"reservations": {"devices": [
        {"driver": "nvidia", "device_ids": [str(i) for i in ids], "capabilities": ["gpu"]}]}}}}


def render(cfg: Config, config_path: str, profile: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Compose services: one rollout server (node 0), one learner (torchrun), one service per actor of its ranks."""
    conf = ["--config", config_path, *(overrides or [])]
    base = {
        "image": IMAGE[profile],
        "build": {"context": "..", "dockerfile": DOCKERFILE[profile]},
        "working_dir": "/app",
        "volumes": ["../artifacts:/app/artifacts", "../runs:/app/runs", "${TANDEM_DATA:-../artifacts/data}:/data",
                    "${TANDEM_MODELS:-../artifacts}:/models"],
        "network_mode": "host",  # loopback ports of the config work unchanged; NCCL needs host networking
        "ipc": "host",
    }
    port, node = cfg.rollout_server.port, node_of(cfg)
    server_here = not node  # node 0, or the only node
    services: dict[str, Any] = {
        "rollout-server": {
            **copy.deepcopy(base),
            "command": ["python", "-m", "rollout_server", *conf],
            "restart": "unless-stopped",
            "healthcheck": {"test": ["CMD", "python", "-c",
                                     f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=3)"],
                            "interval": "10s", "timeout": "5s", "retries": 3, "start_period": "600s"},
            **_gpus(cfg.rollout_server.gpus),
        },
        "learner": {
            **copy.deepcopy(base),
            "command": ["torchrun", *torchrun_args(cfg), "learner/main.py", *conf, "training.resume=auto"],
            "restart": "on-failure",  # resumes from the newest checkpoint (training.resume=auto)
            "depends_on": {"rollout-server": {"condition": "service_healthy"}},
            **_gpus(cfg.learner.gpus),
        },
    }
    for rank in node_ranks(cfg) if actors_wanted(cfg) else []:
        for index in range(cfg.actor.num_actors_per_rank):
            services[f"actor-r{rank}-{index}"] = {
                **copy.deepcopy(base),
                "command": ["python", "-m", "actor", "--rank", str(rank), "--index", str(index), *conf],
                "restart": "on-failure",
                "environment": {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
                "depends_on": {"rollout-server": {"condition": "service_healthy"}},
            }
    if not server_here:  # node k > 0: the server runs on node 0; its processes wait for it themselves
        del services["rollout-server"]
        for service in services.values():
            service.pop("depends_on")
    return {"name": f"tandem-{profile}" + ("" if node is None else f"-node{node}"), "services": services}


def main(argv: list[str] | None = None) -> int:
    ap = cli.config_parser("python -m launcher.compose", __doc__)
    ap.add_argument("--profile", choices=["gpu", "cpu"], default="gpu", help="GPU services or the CPU demo")
    ap.add_argument("--node-rank", type=int, default=None, help="learner node k's file (learner.nnodes > 1)")
    args = ap.parse_args(argv)
    node = [] if args.node_rank is None else [f"launcher.node_rank={args.node_rank}"]
    if (cfg := cli.load(args.config, [*args.overrides, *node])) is None:
        return cli.EXIT_USAGE
    why = (f"learner.nnodes = {cfg.learner.nnodes}: render one file per learner node, with --node-rank k"
           if cfg.learner.nnodes > 1 and args.node_rank is None else node_refusal(cfg, start_server=True))
    if why is not None:
        print(f"launcher.compose: {why}", file=sys.stderr)
        return cli.EXIT_USAGE
    at = [] if args.node_rank is None else [f"--node-rank {args.node_rank}"]
    flags = " ".join([f"--config {args.config} --profile {args.profile}", *at, *map(shlex.quote, args.overrides)])
    header = (f"# Generated by `python -m launcher.compose {flags}`.\n"
              "# Edit the config and regenerate; tests/test_deploy.py checks they agree.\n")
    doc = render(cfg, args.config, args.profile, args.overrides)
    sys.stdout.write(header + yaml.safe_dump(doc, sort_keys=False, width=120))
    return 0


if __name__ == "__main__":
    sys.exit(main())
