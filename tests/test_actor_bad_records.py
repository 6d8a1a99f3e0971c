"""``data.on_bad_record`` in the actor: skip counts the bad record and goes on; fail stops the actor naming it."""

from __future__ import annotations

import json
import threading

import pytest

from actor.loop import EXIT_OK
from common.data.check import BadRecordError
from tests.fake_learner import FakeLearnerRank
from tests.test_actor_loop import DEADLINE_S, ScriptedClient, encoder, make, run_with_deadline  # noqa: F401 - fixtures


@pytest.fixture
def one_bad(tmp_path, synth_data_dir):
    """8 synthetic records, images by absolute path; the third has a box past its image."""
    recs = [json.loads(line) for line in (synth_data_dir / "train.jsonl").read_text().splitlines()[:8]]
    for rec in recs:
        rec["images"] = [str(synth_data_dir / p) for p in rec["images"]]
    recs[2]["objects"][0]["bbox_2d"] = [0, 0, recs[2]["width"] + 9, 5]
    path = tmp_path / "one_bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_skip_counts_the_bad_record_and_the_actor_goes_on(make, encoder, one_bad):
    loop = make(ScriptedClient(encoder.tokenizer), f"data.train_jsonl={one_bad}", "data.on_bad_record=skip",
                "actor.max_samples=8")
    with FakeLearnerRank(loop.cfg.transport, consume_every_s=0.05) as learner:
        assert run_with_deadline(loop) == EXIT_OK
    assert loop.counters()["actor/bad_records"] == 1
    assert len([k for r in learner.received for k in r.keys]) == 7


def test_fail_stops_the_actor_naming_the_record_and_the_fix(make, encoder, one_bad):
    loop = make(ScriptedClient(encoder.tokenizer), f"data.train_jsonl={one_bad}", "actor.max_samples=8")
    raised: list[BaseException] = []

    def run() -> None:
        try:
            loop.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            raised.append(exc)

    with FakeLearnerRank(loop.cfg.transport, consume_every_s=0.05):
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"the actor did not stop within {DEADLINE_S}s"
    assert raised and isinstance(raised[0], BadRecordError), raised
    assert "one_bad.jsonl:3" in str(raised[0]) and "objects[0].bbox_2d" in str(raised[0])
    assert "data.on_bad_record = fail" in str(raised[0])
