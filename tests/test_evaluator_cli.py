"""``python -m evaluator`` as a real process (own hf rollout server), its argument errors, and the drawing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from common.data.records import GTObject
from common.evaluation.metrics import ImageResult, Prediction
from evaluator.__main__ import main
from evaluator.args import MAX_BATCH, MAX_TOKENS
from evaluator.draw import GT_COLOR, PRED_COLOR, SCALE, draw_predictions, grid_geometry

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 240


def evaluator(*args: str, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRANSFORMERS_VERBOSITY": "error"}
    try:
        return subprocess.run([sys.executable, "-m", "evaluator", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"python -m evaluator {' '.join(args)} did not finish in {timeout}s; stderr tail:\n"
                             f"{(exc.stderr or b'')[-3000:]!r}") from None


@pytest.mark.slow
def test_the_evaluator_starts_its_own_server_and_writes_the_report_and_the_grid(tmp_path, tiny_model_dir,
                                                                                 synth_data_dir):
    out, data = tmp_path / "eval", tmp_path / "val.jsonl"
    data.write_text("{broken line\n" + (synth_data_dir / "val.jsonl").read_text())  # images: --image-root
    proc = evaluator("--model", str(tiny_model_dir), "--data", str(data), "--image-root", str(synth_data_dir),
                     "--out", str(out), "--max-images", "4", "--max-new-tokens", "24", "--grid", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "F1@0.5" in proc.stdout and "mAP" in proc.stdout and "ver 0" in proc.stdout
    assert "1 lines skipped" in proc.stdout

    report = json.loads((out / "report.json").read_text())
    for key in ("precision", "recall", "f1", "map", "map_50", "parse_failure_rate", "truncated_rate",
                "objects_per_image", "gt_per_image", "dropped_objects", "score_source", "record", "images",
                "model", "data", "ver", "decoding", "elapsed_s", "server"):
        assert key in report, key
    assert report["n_images"] == 4 and len(report["images"]) == 4
    assert report["n_skipped_lines"] == 1 and report["skipped_lines"][0].startswith("val.jsonl:1: invalid JSON")
    assert report["ver"] == 0 and report["server"]["started_by_evaluator"] is True
    assert report["decoding"]["temperature"] == 0.0 and report["decoding"]["max_tokens"] == 24
    assert report["record"]["eval/n_images"] == 4
    assert all(len(im["text"]) > 0 for im in report["images"])  # real generations came back

    records = [json.loads(line) for line in (synth_data_dir / "val.jsonl").read_text().splitlines()[:3]]
    with Image.open(out / "predictions.png") as png:
        assert png.size == grid_geometry([(r["width"], r["height"]) for r in records])[:2]


def test_a_server_that_exits_during_start_fails_the_run_quoting_its_log(tmp_path, tiny_model_dir, synth_data_dir):
    config = tmp_path / "bad.yaml"
    config.write_text((REPO / "configs" / "demo_cpu.yaml").read_text() + "\nno_such_section: 1\n")
    proc = evaluator("--model", str(tiny_model_dir), "--data", str(synth_data_dir / "val.jsonl"),
                     "--out", str(tmp_path / "o"), "--config", str(config), timeout=120)
    assert proc.returncode == 1
    assert "exited with code 2 during start" in proc.stderr
    assert "no_such_section" in proc.stderr  # the server's own config error, quoted from its log


def test_a_server_that_never_answers_fails_at_the_deadline_naming_what_was_awaited(tmp_path, tiny_model_dir,
                                                                                 synth_data_dir):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = evaluator("--model", str(tiny_model_dir), "--data", str(synth_data_dir / "val.jsonl"),
                     "--out", str(tmp_path / "o"), "--url", f"http://127.0.0.1:{port}", "--server-timeout", "1",
                     timeout=120)
    assert proc.returncode == 1
    assert f"127.0.0.1:{port} not healthy (GET /health 200) after 1 s" in proc.stderr
    assert "python -m rollout_server" in proc.stderr


def test_missing_data_is_exit_2_naming_the_flag(tmp_path, tiny_model_dir):
    proc = evaluator("--model", str(tiny_model_dir), "--out", str(tmp_path / "o"), timeout=60)
    assert proc.returncode == 2
    assert "--data is required" in proc.stderr and "val.jsonl" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_every_bad_argument_is_reported_at_once(tmp_path, capsys):
    code = main(["--model", str(tmp_path / "none"), "--data", str(tmp_path / "v.jsonl"), "--out", str(tmp_path),
                 "--batch-size", "0", "--url", "localhost:8310"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--model" in err and "no config.json" in err
    assert "--data" in err and "no such file" in err
    assert "--batch-size 0" in err and "--url localhost:8310" in err


def test_a_checkpoint_directory_resolves_to_its_model_folder(tmp_path, capsys):
    ckpt = tmp_path / "run" / "checkpoints" / "15"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "config.json").write_text("{}")
    code = main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "o")])  # --data missing: stops at checks
    err = capsys.readouterr().err
    assert code == 2 and "--checkpoint" not in err and "--data is required" in err
    code = main(["--checkpoint", str(tmp_path / "run"), "--data", "x", "--out", "o"])
    assert code == 2 and "RUN/checkpoints/<step>" in capsys.readouterr().err


def test_the_flag_limits_are_the_protocol_limits():
    from common.wire.http import MAX_BATCH as PROTOCOL_MAX_BATCH
    from common.wire.http import MAX_TOKENS_LIMIT

    assert (MAX_TOKENS, MAX_BATCH) == (MAX_TOKENS_LIMIT, PROTOCOL_MAX_BATCH)


def test_the_grid_draws_gt_green_and_predictions_red(tmp_path):
    img = tmp_path / "a.png"
    Image.new("RGB", (100, 50), (128, 128, 128)).save(img)
    gt = GTObject("box", (0, 0, 499, 999))  # left half
    im = ImageResult(width=100, height=50, gt=[gt], preds=[Prediction("box", (500, 0, 999, 999), 0.5)],
                     images=(str(img),), id="a")
    size = draw_predictions([im], tmp_path / "grid.png", n=12)
    with Image.open(tmp_path / "grid.png") as png:
        assert png.size == size == grid_geometry([(100, 50)])[:2]
        colours = {c for _, c in png.convert("RGB").getcolors(maxcolors=1 << 20)}
    assert GT_COLOR in colours and PRED_COLOR in colours
    assert size[0] >= 100 * SCALE
    assert draw_predictions([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


@pytest.mark.slow
def test_a_checkpoint_of_a_run_is_evaluated_with_the_runs_own_prompts_and_report_json_records_them(
        tmp_path, tiny_model_dir, synth_data_dir):
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run / "checkpoints" / "3" / "model")
    cfg = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    cfg["data"]["system_prompt"] = "You find shapes. Answer with one line of JSON."  # not the demo's
    (run / "run_config.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "eval"
    proc = evaluator("--checkpoint", str(run / "checkpoints" / "3"), "--data", str(synth_data_dir / "val.jsonl"),
                     "--out", str(out), "--max-images", "1", "--max-new-tokens", "8", "--grid", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["prompts"] == {"system": "You find shapes. Answer with one line of JSON.",
                                 "user": cfg["data"]["user_prompt"]}
    assert report["config"] == {"path": str((run / "run_config.yaml").resolve()),
                                "source": "the checkpoint's run (run_config.yaml)"}
    assert report["decoding"]["temperature"] == 0.0 and report["decoding"]["max_tokens"] == 8
    assert "ap_by_class" in report and "map_per_class" in report


def test_without_a_run_config_the_default_config_is_the_packages_whatever_the_current_directory(tmp_path,
                                                                                                   monkeypatch):
    from evaluator.args import build_parser, check_args

    ckpt = tmp_path / "run" / "checkpoints" / "2"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)  # configs/demo_cpu.yaml is not here
    args = build_parser().parse_args(["--checkpoint", str(ckpt), "--data", "x", "--out", "o"])
    check_args(args)
    assert args.config == str(REPO / "configs" / "demo_cpu.yaml") and "no run_config.yaml" in args.config_source
    (tmp_path / "run" / "run_config.yaml").write_text("model: {path: m}\n")
    args = build_parser().parse_args(["--checkpoint", str(ckpt), "--data", "x", "--out", "o"])
    check_args(args)
    assert args.config == str(tmp_path / "run" / "run_config.yaml")
