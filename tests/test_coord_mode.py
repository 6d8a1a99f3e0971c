"""No silent coordinate guess: ``data.coord_mode`` (or the record's own ``coord_mode``) declares how boxes are read.

The origin's example: a 768x512 image, ``[100, 120, 180, 200]`` in norm1000, no coord_mode field. Read
as pixels (what tandem did before) it became bins (130, 234, 234, 390), a different box.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from common.data.records import RecordError, iter_jsonl, load_record
from common.config.load import load_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo_cpu.yaml"
ORIGIN = {"images": ["origin.png"], "width": 768, "height": 512,
          "objects": [{"desc": "black cat", "bbox_2d": [100, 120, 180, 200]}]}


@pytest.fixture
def origin_jsonl(tmp_path) -> Path:
    Image.new("RGB", (768, 512), (90, 90, 90)).save(tmp_path / "origin.png")
    path = tmp_path / "origin.jsonl"
    path.write_text(json.dumps(ORIGIN) + "\n")
    return path


def test_a_record_without_coord_mode_and_no_declared_mode_is_an_error_naming_data_coord_mode():
    with pytest.raises(RecordError) as info:
        load_record(ORIGIN, where="origin.jsonl:1")
    assert info.value.field == "coord_mode"
    assert "data.coord_mode: norm1000" in info.value.fix and "does not guess" in info.value.problem


def test_declared_norm1000_keeps_the_origins_bins_as_they_are():
    assert load_record(ORIGIN, coord_mode="norm1000").objects[0].bins == (100, 120, 180, 200)
    # the same numbers declared as pixels are a different box: why nothing may be guessed
    assert load_record(ORIGIN, coord_mode="pixel").objects[0].bins == (130, 234, 234, 390)


@pytest.mark.parametrize("own, declared", [("pixel", "norm1000"), ("norm1000", "pixel")])
def test_a_record_whose_own_mode_disagrees_with_the_declared_one_is_an_error_not_a_rescale(own, declared):
    with pytest.raises(RecordError) as info:
        load_record({**ORIGIN, "coord_mode": own}, where="t.jsonl:3", coord_mode=declared)
    assert info.value.field == "coord_mode" and str(info.value).startswith("t.jsonl:3: coord_mode: ")
    assert f"data.coord_mode: {own}" in info.value.fix and "never rescales" in info.value.problem


def test_a_record_that_carries_its_mode_needs_no_declaration_and_agreeing_ones_pass():
    rec = {**ORIGIN, "coord_mode": "norm1000"}
    assert load_record(rec).objects == load_record(rec, coord_mode="norm1000").objects


def test_synthetic_records_carry_their_own_pixel_mode(synth_data_dir):
    first = json.loads((synth_data_dir / "train.jsonl").read_text().splitlines()[0])
    assert first["coord_mode"] == "pixel"
    assert len(list(iter_jsonl(synth_data_dir / "train.jsonl"))) == 56  # no data.coord_mode needed


def test_data_check_of_origin_records_fails_naming_data_coord_mode_and_passes_once_declared(origin_jsonl, tiny_model_dir):
    def check(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tandem", "data", "check", str(origin_jsonl), "--config",
                               str(CONFIG), f"model.path={tiny_model_dir}", *overrides], cwd=REPO,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})

    undeclared = check()
    assert undeclared.returncode == 1 and "data.coord_mode" in undeclared.stdout, undeclared.stdout
    declared = check("data.coord_mode=norm1000")
    assert declared.returncode == 0, declared.stdout + declared.stderr
    assert "1 records, 1 good, 0 bad" in declared.stdout and "norm1000 (data.coord_mode) 1" in declared.stdout


def test_the_learner_trains_the_origins_record_on_the_bins_the_origin_meant(origin_jsonl, tiny_model_dir):
    from common.packing.encode import encoder_from_config
    from learner.data import ChannelAData

    cfg = load_config(CONFIG, [f"model.path={tiny_model_dir}", f"data.train_jsonl={origin_jsonl}",
                               "data.val_jsonl=null", "data.coord_mode=norm1000", "training.global_max_length=8192"],
                      world_size=1)
    data = ChannelAData(cfg, encoder_from_config(cfg), rank=0, world_size=1, ga=1, samples=1)
    (pack,) = data.next_window(ver=0)
    assert pack.segments[0].coord_bins.tolist() == [100, 120, 180, 200]


def test_the_config_takes_only_the_two_modes():
    from common.config.load import ConfigError

    assert load_config(CONFIG, ["data.coord_mode=pixel"]).data.coord_mode == "pixel"
    assert load_config(CONFIG).data.coord_mode is None
    with pytest.raises(ConfigError, match="data.coord_mode"):
        load_config(CONFIG, ["data.coord_mode=relative"])
