"""Deploy files and the launcher's plan agree with the configs they were made from."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.config.load import load_config
from launcher.compose import render
from launcher.plan import PlanError, build_plan

REPO = Path(__file__).resolve().parents[1]
COMPOSES = [("deploy/docker-compose.yml", "configs/stage2_ab/async.yaml", "gpu"),
            ("deploy/docker-compose.cpu.yml", "configs/demo_cpu.yaml", "cpu")]


def device_ids(service):
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return sorted(int(i) for d in devices for i in d["device_ids"])


@pytest.mark.parametrize("compose,config,profile", COMPOSES)
def test_compose_services_commands_and_gpu_sets_agree_with_the_config(compose, config, profile):
    cfg = load_config(REPO / config)
    services = yaml.safe_load((REPO / compose).read_text())["services"]
    actors = {f"actor-r{r}-{i}" for r in range(cfg.learner.nproc_per_node) for i in range(cfg.actor.num_actors_per_rank)}
    assert set(services) == {"rollout-server", "learner"} | actors
    server, learner = services["rollout-server"], services["learner"]
    assert device_ids(server) == sorted(cfg.rollout_server.gpus or [])
    assert device_ids(learner) == sorted(cfg.learner.gpus or [])
    assert not set(device_ids(server)) & set(device_ids(learner))
    assert server["command"][:3] == ["python", "-m", "rollout_server"] and config in server["command"]
    assert f"--nproc_per_node={cfg.learner.nproc_per_node}" in learner["command"] and config in learner["command"]
    assert "healthcheck" in server and str(cfg.rollout_server.port) in " ".join(server["healthcheck"]["test"])
    for name in actors:
        cmd = services[name]["command"]
        assert cmd[:3] == ["python", "-m", "actor"] and config in cmd
        assert device_ids(services[name]) == []
    assert learner["depends_on"]["rollout-server"]["condition"] == "service_healthy"


@pytest.mark.parametrize("compose,config,profile", COMPOSES)
def test_committed_compose_file_is_what_the_generator_renders(compose, config, profile):
    cfg = load_config(REPO / config)
    assert yaml.safe_load((REPO / compose).read_text()) == render(cfg, config, profile), (
        f"{compose} is out of date: python -m launcher.compose --config {config} --profile {profile} > {compose}")


def test_launcher_refuses_overlapping_gpu_sets_before_starting_anything():
    cfg = load_config(REPO / "configs/stage2_ab/async.yaml")
    cfg.learner.gpus = [5, 6]
    with pytest.raises(PlanError, match="overlap"):
        build_plan(cfg, "c.yaml", [], Path("/tmp/logs"))


def test_launcher_dry_run_prints_every_process_and_exits_zero(tmp_path):
    # a fresh output_dir: the dry run also checks it (runs/demo may hold the user's last demo)
    res = subprocess.run([sys.executable, "-m", "launcher", "--config", "configs/demo_cpu.yaml", "--dry-run",
                          f"training.output_dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    for name in ("rollout_server", "learner", "actor_r0_0", "actor_r1_0"):
        assert f"[{name}]" in res.stdout


def test_launcher_dry_run_reports_config_errors_with_exit_code_2():
    res = subprocess.run([sys.executable, "-m", "launcher", "--config", "configs/stage2_ab/async.yaml", "--dry-run",
                          "learner.gpus=[0,1]"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "learner.gpus" in res.stderr and "disjoint" in res.stderr


@pytest.mark.parametrize("mode", ["step", "micro"])
def test_synchronous_modes_start_no_actor_processes(mode):
    # step/micro roll out inside the learner: actors would wait for credits nobody publishes, then exit 3.
    extra = [] if mode == "step" else ["stage2_ab.channel_b.rollouts_per_step=null"]  # a step-mode key
    cfg = load_config(REPO / "configs/stage2_ab/step_single_gpu.yaml", [f"stage2_ab.channel_b.mode={mode}",
                                                                      "stage2_ab.channel_b.enable_pipeline=false", *extra])
    specs = build_plan(cfg, "c.yaml", [], Path("/tmp/logs"))
    assert [s.role for s in specs] == ["server", "learner"]
    assert set(render(cfg, "c.yaml", "gpu")["services"]) == {"rollout-server", "learner"}
    cfg = load_config(REPO / "configs/demo_cpu.yaml")
    assert [s.role for s in build_plan(cfg, "c.yaml", [], Path("/tmp/logs"))].count("actor") == 2  # async: per rank


TWO_NODES = ["learner.nnodes=2", "learner.nproc_per_node=2", "learner.rdzv_endpoint=10.0.0.1:29400",
             "learner.node_hosts=[10.0.0.1,10.0.0.2]",
             "rollout_matching.vllm.servers=[{base_url: 'http://10.0.0.1:8310'}]",
             "rollout_server.host=0.0.0.0", "rollout_server.auth_token=secret"]


def two_node_config(node):
    return load_config(REPO / "configs/demo_cpu.yaml", [*TWO_NODES, f"launcher.node_rank={node}"])


def test_each_learner_node_plans_its_own_ranks_and_actors_and_only_node_0_the_server():
    plans = {node: build_plan(two_node_config(node), "c.yaml", [], Path(f"/tmp/logs/node{node}")) for node in (0, 1)}
    assert [s.name for s in plans[0]] == ["rollout_server", "learner", "actor_r0_0", "actor_r1_0"]
    assert [s.name for s in plans[1]] == ["learner", "actor_r2_0", "actor_r3_0"]
    torchrun = {node: next(s.argv for s in plan if s.role == "learner") for node, plan in plans.items()}
    for node, argv in torchrun.items():
        assert {"--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2", "--rdzv_backend=static",
                "--rdzv_endpoint=10.0.0.1:29400"} <= set(argv) and "--standalone" not in argv
    rdzv_ids = {node: [a for a in argv if a.startswith("--rdzv_id=")] for node, argv in torchrun.items()}
    assert rdzv_ids[0] == rdzv_ids[1] and len(rdzv_ids[0]) == 1  # both nodes join the same rendezvous


def test_a_launcher_of_several_learner_nodes_needs_its_node_rank():
    cfg = load_config(REPO / "configs/demo_cpu.yaml", TWO_NODES)
    with pytest.raises(PlanError, match=r"launcher\.node_rank=k` on each node k = 0\.\.1"):
        build_plan(cfg, "c.yaml", [], Path("/tmp/logs"))


def test_node_0_refuses_a_loopback_server_that_the_other_nodes_actors_must_reach():
    cfg = load_config(REPO / "configs/demo_cpu.yaml", [*TWO_NODES[:-2], "launcher.node_rank=0"])
    with pytest.raises(PlanError, match="rollout_server.host = '127.0.0.1'"):
        build_plan(cfg, "c.yaml", [], Path("/tmp/logs"))
    assert build_plan(cfg, "c.yaml", [], Path("/tmp/logs"), start_server=False)[0].role == "learner"  # --no-server


def test_per_node_compose_files_split_the_services_like_the_launcher():
    files = {node: render(two_node_config(node), "c.yaml", "cpu", ["x.y=1"]) for node in (0, 1)}
    assert set(files[0]["services"]) == {"rollout-server", "learner", "actor-r0-0", "actor-r1-0"}
    assert set(files[1]["services"]) == {"learner", "actor-r2-0", "actor-r3-0"}
    assert files[0]["name"] != files[1]["name"]
    node1 = files[1]["services"]
    assert "--node_rank=1" in node1["learner"]["command"] and "x.y=1" in node1["actor-r2-0"]["command"]
    assert not any("depends_on" in service for service in node1.values())  # no server service on node 1


def test_launcher_dry_run_of_several_nodes_without_a_node_rank_exits_2_naming_the_key(tmp_path):
    res = subprocess.run([sys.executable, "-m", "launcher", "--config", "configs/demo_cpu.yaml", "--dry-run",
                          f"training.output_dir={tmp_path / 'run'}", *TWO_NODES], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "launcher.node_rank" in res.stderr, res.stderr
    res = subprocess.run([sys.executable, "-m", "launcher", "--config", "configs/demo_cpu.yaml", "--dry-run",
                          f"training.output_dir={tmp_path / 'run'}", *TWO_NODES, "launcher.node_rank=1"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "learner node 1 of 2" in res.stdout and "[rollout_server]" not in res.stdout
    assert "[actor_r2_0]" in res.stdout and "[actor_r0_0]" not in res.stdout
