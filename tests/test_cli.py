"""The ``tandem`` command and the one entry helper (``common/runs/cli.py``): every entry point answers ``--help``
through it, config errors exit 2 naming the key, every process logs in one format, entry points stay thin."""

from __future__ import annotations

import ast
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common.runs import cli
from tandem.cli import COMMANDS, LEARNER_SCRIPT, torchrun_command

REPO = Path(__file__).resolve().parents[1]
HELP_DEADLINE_S = 60.0  # all the --help subprocesses together, on a loaded 2-core box
MAX_ENTRY_LINES = 60
#: Entry points measured whole (the ``__main__.py`` files are found, these are the scripts torchrun runs).
SCRIPTS = ("learner/main.py", "stage_b/main.py")


def run_all(commands: dict[str, list[str]]) -> dict[str, subprocess.CompletedProcess]:
    """Run every command at once (they are independent); fail naming the ones still running at the deadline."""
    procs = {k: subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, cmd in commands.items()}
    deadline, done = time.monotonic() + HELP_DEADLINE_S, {}
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            done[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {HELP_DEADLINE_S:.0f}s: "
                             f"{[k for k, p in procs.items() if p.poll() is None]}") from None
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def test_tandem_help_lists_every_command_with_one_line_each():
    tandem = shutil.which("tandem")
    assert tandem, "no `tandem` script on PATH: `pip install -e .` registers it ([project.scripts] in pyproject.toml)"
    proc = subprocess.run([tandem, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    listed = dict(re.findall(r"^  (\S+)\s+(.+)$", proc.stdout, flags=re.M))
    assert set(listed) == set(COMMANDS)
    assert {"launch", "serve", "actor", "learner", "eval", "stage-b", "plot", "summary", "warm-start", "data",
            "tiny-model"} <= set(listed)


def test_every_command_and_script_answers_help_with_exit_0():
    commands = {name: [sys.executable, "-m", "tandem", name, "--help"] for name in COMMANDS}
    commands |= {script: [sys.executable, script, "--help"] for script in SCRIPTS}  # as torchrun runs them
    for name, proc in run_all(commands).items():
        assert proc.returncode == 0, f"{name} --help exited {proc.returncode}:\n{proc.stderr[-2000:]}"
        assert "usage:" in proc.stdout, f"{name} --help printed no usage:\n{proc.stdout[-2000:]}"


def test_tandem_help_imports_no_entry_point_and_no_torch():
    code = ("import sys; from tandem.cli import main; main(['--help']); "
            "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'torch', 'actor', 'learner', 'rollout_server', 'stage_b', 'launcher', 'evaluator', 'tools'}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "LOADED []"


def test_a_bad_config_key_through_tandem_serve_exits_2_naming_the_key():
    proc = subprocess.run([sys.executable, "-m", "tandem", "serve", "--config", "configs/demo_cpu.yaml",
                           "rollout_server.bad_key=1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "rollout_server.bad_key" in proc.stderr and "unknown key" in proc.stderr and "Fix:" in proc.stderr


def test_an_unknown_command_exits_2_with_the_closest_one():
    proc = subprocess.run([sys.executable, "-m", "tandem", "lerner"], cwd=REPO, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "tandem learner" in proc.stderr


def test_tandem_learner_with_several_ranks_runs_the_script_under_torchrun():
    cmd = torchrun_command(2, ["--config", "c.yaml", "training.max_steps=3"])
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert cmd[5:] == [str(LEARNER_SCRIPT), "--config", "c.yaml", "training.max_steps=3"]
    assert LEARNER_SCRIPT.is_file()


def test_overrides_may_come_before_between_and_after_the_flags():
    ap = cli.config_parser("x", None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(["a.b=1", "--config", "c.yaml", "c.d=2", "--dry-run", "e.f=3"])
    assert (args.config, args.overrides, args.dry_run) == ("c.yaml", ["a.b=1", "c.d=2", "e.f=3"], True)


def test_a_log_line_carries_process_name_rank_and_pid():
    record = logging.LogRecord("learner.train", logging.INFO, __file__, 1, "step %d done", (12,), None)
    line = logging.Formatter(cli.log_format("learner", rank=1)).format(record)
    assert re.fullmatch(rf"\d{{4}}-\d\d-\d\d [\d:,]+ INFO \[learner r1 {os.getpid()}\] learner.train: step 12 done",
                        line), line
    line = logging.Formatter(cli.log_format("rollout_server")).format(record)
    assert f" INFO [rollout_server {os.getpid()}] learner.train: " in line  # no rank: none shown


def test_setup_logging_writes_the_format_to_stderr_and_quiets_httpx():
    code = ("import logging; from common.runs import cli; cli.setup_logging('actor-r0-1'); "
            "logging.getLogger('actor.loop').info('hello'); logging.getLogger('httpx').info('HTTP Request: noise')")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert re.fullmatch(rf"\S+ \S+ INFO \[actor-r0-1 {proc.pid}\] actor\.loop: hello\n", err), err


def _entry_points() -> tuple[list[Path], list[Path]]:
    """(files measured whole, files whose ``main()`` is measured): every ``__main__.py`` and torchrun script,
    and the module behind every ``tandem`` command."""
    whole = sorted(p for p in REPO.glob("*/__main__.py")) + [REPO / s for s in SCRIPTS]
    modules = {REPO / (c.module.replace(".", "/") + ".py") for c in COMMANDS.values()}
    return whole, sorted(modules - set(whole) | {REPO / "tandem" / "cli.py"})


def test_every_entry_point_is_at_most_60_lines():
    whole, with_main = _entry_points()
    too_long = [f"{p.relative_to(REPO)}: {n} lines" for p in whole
                if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_ENTRY_LINES]
    for path in with_main:
        mains = [node for node in ast.parse(path.read_text(encoding="utf-8")).body
                 if isinstance(node, ast.FunctionDef) and node.name == "main"]
        assert mains, f"{path.relative_to(REPO)} has no main(argv) -> int for `tandem`"
        if (n := mains[0].end_lineno - mains[0].lineno + 1) > MAX_ENTRY_LINES:
            too_long.append(f"{path.relative_to(REPO)}: main() is {n} lines")
    names = {p.relative_to(REPO).as_posix() for p in whole + with_main}  # the lists found what they should
    assert {"actor/__main__.py", "rollout_server/__main__.py", "launcher/__main__.py", "evaluator/__main__.py",
            "learner/main.py", "stage_b/main.py", "stage_b/launch.py", "learner/warm_start.py", "common/data/cli.py",
            "tools/make_tiny_model.py", "launcher/plot.py", "launcher/summary.py"} <= names, names
    assert not too_long, ("entry points parse, load the config, name the process and call one run() "
                          "(common/runs/cli.py); move the rest into the library:\n" + "\n".join(too_long))
