"""Deploy files and the launcher's plan agree with the configs they were made from."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.config import load_config
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
