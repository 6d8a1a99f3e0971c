"""Stage-B in one process: shard arithmetic, tickets, parsing, selection, guidance, reflection, launcher.

The multi-rank behaviour (guidance isolation, global reflection trigger, rank-0-only artifacts,
fail-fast) is tested with real ranks in tests/test_stage_b_dist.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.config.load import ConfigError
from stage_b.config import ReflectionConfig, load_stage_b_config
from stage_b.distributed import epoch_order, global_batches, resolve_placement, shard_bounds
from stage_b.guidance import GuidanceRepo
from stage_b.launch import build_command, parse_gpus
from stage_b.prompts import parse_operations, parse_verdict
from stage_b.reflection import ReflectionEngine
from stage_b.selection import Candidate, failure_reason, select
from stage_b.tickets import TicketError, check_tickets, load_tickets, make_demo_tickets

# ------------------------------------------------------------------------------------------ shards


def batches_and_shards(n: int, P: int, W: int) -> list[list[tuple[int, int]]]:
    """Absolute [lo, hi) per rank for every global batch of an epoch of n tickets."""
    out = []
    for start, end in global_batches(n, P * W):
        out.append([(start + lo, start + hi) for lo, hi in (shard_bounds(end - start, W, r) for r in range(W))])
    return out


@pytest.mark.parametrize("n", [0, 1, 5, 8, 13, 64, 97])
@pytest.mark.parametrize("P,W", [(1, 1), (4, 1), (1, 2), (2, 2), (4, 2), (3, 3), (2, 8), (16, 8)])
def test_every_global_batch_is_covered_exactly_once_and_no_rank_gets_more_than_P(n, P, W):
    batches = batches_and_shards(n, P, W)
    seen = [i for shards in batches for lo, hi in shards for i in range(lo, hi)]
    assert seen == list(range(n))  # contiguous, in order, each ticket exactly once
    for b, shards in enumerate(batches):
        sizes = [hi - lo for lo, hi in shards]
        assert max(sizes) <= P
        assert sum(sizes) == P * W or b == len(batches) - 1  # only the last batch is short
        if sum(sizes) == P * W:
            assert sizes == [P] * W
        assert max(sizes) - min(sizes) <= 1  # a short batch is spread evenly


@given(n=st.integers(0, 300), P=st.integers(1, 16), W=st.integers(1, 8))
def test_shard_bounds_partition_any_batch(n, P, W):
    test_every_global_batch_is_covered_exactly_once_and_no_rank_gets_more_than_P(n, P, W)


def test_shard_bounds_example_and_errors():
    assert [shard_bounds(7, 3, r) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [shard_bounds(1, 2, r) for r in range(2)] == [(0, 1), (1, 1)]
    with pytest.raises(ValueError):
        shard_bounds(4, 2, 2)


def test_epoch_order_is_the_same_on_every_rank_and_changes_per_epoch():
    assert epoch_order(20, 0, 1, True) == epoch_order(20, 0, 1, True)
    assert epoch_order(20, 0, 0, True) != epoch_order(20, 0, 1, True)
    assert epoch_order(5, 0, 0, False) == [0, 1, 2, 3, 4]


def test_device_map_auto_is_forced_to_the_local_rank_under_world_size_above_one():
    assert resolve_placement("auto", 4, 3, 8).device == "cuda:3"
    assert resolve_placement("auto", 4, 3, 8).device_map is None  # the whole model on that one GPU
    assert resolve_placement("cuda:0", 2, 1, 2).device == "cuda:1"
    assert resolve_placement("auto", 1, 0, 2) == resolve_placement("auto", 1, 0, 2).__class__("cuda:0", "auto")
    assert resolve_placement("auto", 1, 0, 1).device_map is None  # one GPU: load onto it
    assert resolve_placement("auto", 2, 1, 0).device == "cpu"
    assert resolve_placement("cpu", 2, 1, 2).device == "cpu"


# ------------------------------------------------------------------------------------------ tickets


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ticket(gid, label="pass", mission="m", uid=None, summaries=("a",)):
    return {"group_id": gid, "label": label, "mission": mission, "summaries": list(summaries), "uid": uid}


def test_ticket_key_is_uid_or_group_and_label(tmp_path):
    p = write_jsonl(tmp_path / "t.jsonl", [ticket("g1", "fail"), ticket("g1", "pass", uid="u-7"),
                                           {**ticket("g2"), "summaries": {"image_2": "b", "image_1": "a"}}])
    tickets, mission = load_tickets(p)
    assert [t.key for t in tickets] == ["g1::fail", "u-7", "g2::pass"]
    assert tickets[2].summaries == ("a", "b") and mission == "m"


def test_more_than_one_mission_is_a_clear_error(tmp_path):
    p = write_jsonl(tmp_path / "t.jsonl", [ticket("g1", mission="a"), ticket("g2", mission="b")])
    with pytest.raises(TicketError, match="exactly one mission"):
        load_tickets(p)


@pytest.mark.parametrize("bad,match", [({"group_id": "g", "label": "pass"}, "missing"),
                                       (ticket("g", label="maybe"), "pass|fail"),
                                       ({**ticket("g"), "summaries": []}, "summaries")])
def test_bad_ticket_lines_name_the_line(tmp_path, bad, match):
    p = write_jsonl(tmp_path / "t.jsonl", [ticket("ok"), bad])
    with pytest.raises(TicketError, match=match) as exc:
        load_tickets(p)
    assert "t.jsonl:2" in str(exc.value)


def test_duplicate_keys_fail():
    with pytest.raises(TicketError, match="appears at"):
        check_tickets(make_demo_tickets(2) + make_demo_tickets(2))


def test_demo_tickets_are_deterministic_with_one_mission():
    a, b = make_demo_tickets(10, seed=3), make_demo_tickets(10, seed=3)
    assert a == b and len({t.mission for t in a}) == 1
    assert sum(t.label == "fail" for t in a) == 5
    check_tickets(a)


# ------------------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize("text,verdict,ok", [
    ("pass\nall boxes sealed", "pass", True),
    ("Verdict: FAIL.\nReason: torn tape on image 2", "fail", True),
    ("  fail  \n\n the label is missing \n", "fail", True),
    ("fail", "fail", False),  # no reason
    ("pass\nreason\nextra line", "pass", False),
    ("looks ok to me\nsealed", None, False),
    ("", None, False),
    ("<|coord_3|> garbage", None, False),
])
def test_verdict_parsing_flags_format(text, verdict, ok):
    v = parse_verdict(text)
    assert (v.verdict, v.format_ok) == (verdict, ok)


def test_operations_parse_from_surrounding_text_or_fail():
    assert parse_operations('sure: ```json\n{"operations": [{"op": "remove", "id": "G0"}]}\n```') == [
        {"op": "remove", "id": "G0"}]
    assert parse_operations('{"ops": []}') is None
    assert parse_operations("no json {here") is None
    assert parse_operations('{"operations": []}') == []


# ------------------------------------------------------------------------------------------ selection


def cand(verdict, fmt=True, temp=0.7, key="k"):
    return Candidate(ticket_key=key, rank=0, guidance_step=0, decode_index=0, sample_index=0, temperature=temp,
                     top_p=1.0, max_new_tokens=8, seed=None, text="", finish_reason="stop", verdict=verdict,
                     reason="r" if fmt else "", format_ok=fmt)


def test_failures_are_classified():
    assert failure_reason([]) == "no_candidates"
    assert failure_reason([cand(None, False), cand(None, False)]) == "format_error"
    assert failure_reason([cand("pass", False), cand(None, False)]) == "no_valid_candidates"
    assert failure_reason([cand("pass", False), cand("fail")]) is None


def test_majority_vote_strength_and_learnability():
    s = select([cand("fail"), cand("fail"), cand("pass"), cand(None, False)], "fail", "prefer_pass", 0.67)
    assert (s.verdict, s.votes, s.tied, s.mixed) == ("fail", {"fail": 2, "pass": 1}, False, True)
    assert s.vote_strength == pytest.approx(2 / 3) and s.label_match
    assert s.learnable and s.learnable_because == ["mixed_verdicts", "low_agreement"]
    clean = select([cand("pass"), cand("pass")], "pass", "prefer_fail", 0.67)
    assert not clean.learnable and clean.vote_strength == 1.0
    wrong = select([cand("pass")], "fail", "prefer_fail", 0.67)
    assert wrong.learnable_because == ["label_mismatch"]


@pytest.mark.parametrize("policy,expected", [("prefer_fail", "fail"), ("prefer_pass", "pass"),
                                             ("lowest_temperature", "pass")])
def test_ties_follow_the_configured_tie_break(policy, expected):
    s = select([cand("fail", temp=0.9), cand("pass", temp=0.2)], "fail", policy, 0.5)
    assert s.tied and s.verdict == expected and s.vote_strength == 0.5


# ------------------------------------------------------------------------------------------ guidance


def test_guidance_operations_are_validated_and_bump_the_step_once(tmp_path):
    repo = GuidanceRepo("m", tmp_path, ["seed rule"], retention=2)
    assert repo.snapshot().step == 0 and repo.snapshot().experiences == (("G0", "seed rule"),)
    res = repo.apply([
        {"op": "upsert", "id": None, "text": "torn tape fails", "evidence": ["a", "zzz"]},
        {"op": "upsert", "id": "G0", "text": "seed rule v2", "evidence": ["b"]},
        {"op": "remove", "id": "G9", "evidence": ["a"]},  # unknown id
        {"op": "upsert", "text": "no evidence", "evidence": ["not-in-batch"]},
        {"op": "explode", "evidence": ["a"]},
    ], batch_keys=["a", "b"], max_ops=4)
    assert (res.step_before, res.step_after) == (0, 1)
    assert [i["why"] for i in res.invalid] == ["unknown_id", "no_evidence_in_batch", "unknown_op"]
    assert res.evidence == {"a", "b"}
    assert dict(repo.snapshot().experiences) == {"G0": "seed rule v2", "G1": "torn tape fails"}
    res = repo.apply([{"op": "merge", "ids": ["G0", "G1"], "text": "one rule", "evidence": ["c"]},
                      {"op": "upsert", "text": "over the cap", "evidence": ["c"]}], batch_keys=["c"], max_ops=1)
    assert res.dropped_over_cap == 1 and dict(repo.snapshot().experiences) == {"G2": "one rule"}
    assert repo.apply([], ["c"], 4).step_after == 2  # nothing applied: no new step
    saved = json.loads((tmp_path / "guidance.json").read_text())
    assert saved["step"] == 2 and [e["id"] for e in saved["experiences"]] == ["G2"]
    assert sorted(p.name for p in (tmp_path / "guidance_snapshots").iterdir()) == ["step_000001.json",
                                                                                  "step_000002.json"]


# ------------------------------------------------------------------------------------------ reflection


def learnable(i):
    return {"ticket_key": f"t{i}", "label": "fail", "verdict": "pass", "votes": {"pass": 1}, "vote_strength": 1.0,
            "summaries": ["x"], "reasons": ["r"]}


class FakeModel:
    """Answers reflection prompts: malformed for the first ``bad`` calls, then cites every ticket."""

    def __init__(self, bad=0):
        self.bad, self.seen = bad, []

    def __call__(self, messages):
        keys = [ln.split(": label=")[0][len("ticket "):] for ln in messages[1]["content"].splitlines()
                if ln.startswith("ticket ")]
        self.seen.append(keys)
        if len(self.seen) <= self.bad:
            return "I think the guidance should say more about tape."
        return json.dumps({"operations": [{"op": "upsert", "text": "rule", "evidence": keys}]})


def engine(model, bs=8, attempts=3):
    emitted = []
    repo = GuidanceRepo("m", None, [], retention=1)
    eng = ReflectionEngine(model, repo, ReflectionConfig(batch_size=bs, max_attempts=attempts), "m",
                           lambda name, rec: emitted.append((name, rec)))
    return eng, repo, emitted


def test_reflection_triggers_when_the_pending_count_reaches_batch_size():
    model = FakeModel()
    eng, repo, _ = engine(model, bs=3)
    assert [eng.add(learnable(i), {}) for i in range(7)] == [0, 0, 1, 0, 0, 1, 0]
    assert model.seen == [["t0", "t1", "t2"], ["t3", "t4", "t5"]] and repo.step == 2
    assert eng.flush({}) == 1 and model.seen[-1] == ["t6"] and repo.step == 3 and not eng.pending


def test_malformed_reflection_is_counted_and_retried_with_a_halved_batch():
    model = FakeModel(bad=2)
    eng, repo, emitted = engine(model, bs=8)
    for i in range(8):
        eng.add(learnable(i), {})
    assert [len(k) for k in model.seen[:3]] == [8, 4, 2]  # max(1, 8 // 2**attempt)
    assert eng.counters.malformed == 2 and repo.step >= 1
    log = [r for n, r in emitted if n == "reflection"]
    assert [a["records"] for a in log[0]["attempts"]] == [8, 4, 2] and log[0]["records"] == ["t0", "t1"]
    assert eng.flush({}) >= 1 and not eng.pending


def test_reflection_that_never_parses_sends_its_records_to_need_review():
    model = FakeModel(bad=10**6)
    eng, repo, emitted = engine(model, bs=4, attempts=2)
    for i in range(4):
        eng.add(learnable(i), {})
    assert len(model.seen) == 2 and repo.step == 0 and not eng.pending
    review = [r for n, r in emitted if n == "need_review_queue"]
    assert [r["ticket_key"] for r in review] == ["t0", "t1", "t2", "t3"]
    assert {r["reason"] for r in review} == {"reflection_malformed"}


# ------------------------------------------------------------------------------------------ config, launcher


def test_stage_b_config_reports_every_problem_with_its_key():
    with pytest.raises(ConfigError) as exc:
        load_stage_b_config("configs/stage_b/demo_cpu.yaml", ["runner.per_rank_rollout_batch_size=0",
                                                               "sampler.grid=[{top_p: 2.0}]", "reflection.batchsize=4",
                                                               "tickets.path=/nope.jsonl"])
    text = str(exc.value)
    for key in ("runner.per_rank_rollout_batch_size", "sampler.grid[0].top_p", "reflection.batchsize",
                "tickets.path"):
        assert key in text
    assert "did you mean reflection.batch_size" in text


def test_demo_config_uses_the_real_model():
    cfg = load_stage_b_config("configs/stage_b/demo_cpu.yaml")
    assert cfg.sampler.backend == "hf" and cfg.model.device_map == "auto"
    assert load_stage_b_config(None, ["model.path=m"]).sampler.backend == "hf"  # the default too


def test_launcher_runs_one_gpu_plainly_and_several_under_torchrun():
    cmd, env = build_command(parse_gpus("3"), "c.yaml", ["runner.epochs=2"])
    assert cmd[0] == sys.executable and cmd[1].endswith("stage_b/main.py") and "torch.distributed.run" not in cmd
    assert env == {"CUDA_VISIBLE_DEVICES": "3"} and cmd[-1] == "runner.epochs=2"
    cmd, env = build_command(parse_gpus("0,1,2,3"), "c.yaml", [])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nnodes=1" in cmd and "--nproc_per_node=4" in cmd
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    for bad in ("", "0,0", "a,b"):
        with pytest.raises(ValueError):
            parse_gpus(bad)


def test_launcher_dry_run_prints_the_command(capsys):
    from stage_b.launch import main

    assert main(["--gpus", "0,1", "--config", "configs/stage_b/demo_cpu.yaml", "--dry-run"]) == 0
    line = capsys.readouterr().out
    assert "CUDA_VISIBLE_DEVICES=0,1" in line and "--nproc_per_node=2" in line and "--nnodes=1" in line


# ------------------------------------------------------------------------------------------ one process


def test_single_process_run_is_the_same_pipeline_with_world_size_one(tmp_path, monkeypatch):
    from stage_b.runner import run_all

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_stage_b_config(None, [
        "model.path=unused", "sampler.backend=scripted", "sampler.scripted.verdict=hash",
        "sampler.scripted.malformed_share=0.2", "sampler.samples_per_decode=2",
        "tickets.demo.num_groups=10", "runner.per_rank_rollout_batch_size=4", "reflection.batch_size=3",
        f"output.root={tmp_path}", "runner.epochs=2",
    ])
    summary = run_all(cfg)
    assert summary.world == 1 and [b["bounds"] for b in summary.batches] == [[0, 4], [0, 4], [0, 2]] * 2
    run_dir = tmp_path / "stage_b"
    (mission_dir,) = run_dir.iterdir()
    names = {p.name for p in mission_dir.iterdir()}
    assert {"trajectories.jsonl", "selections.jsonl", "failure_malformed.jsonl", "reflection.jsonl",
            "need_review_queue.jsonl", "metrics.jsonl", "guidance.json", "guidance_snapshots",
            "need_review.json", "run_summary.json"} <= names
    sels = [json.loads(x) for x in (mission_dir / "selections.jsonl").read_text().splitlines()]
    fails = [json.loads(x) for x in (mission_dir / "failure_malformed.jsonl").read_text().splitlines()]
    assert len(sels) + len(fails) == 20 and sels  # every ticket of both epochs accounted for
    assert summary.reflection_cycles >= 1 and summary.final_step >= 1
    assert json.loads((mission_dir / "run_summary.json").read_text())["status"] == "ok"


def test_run_summary_records_rank_zero_timing_and_every_file_it_wrote(tmp_path, monkeypatch):
    from stage_b.runner import run_all

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_stage_b_config(None, [
        "model.path=unused", "sampler.backend=scripted", "sampler.scripted.verdict=pass", "guidance.snapshot_retention=1",
        "tickets.demo.num_groups=10", "runner.per_rank_rollout_batch_size=4", "reflection.batch_size=3",
        f"output.root={tmp_path}", "runner.epochs=2",
    ])
    summary = run_all(cfg)
    mission_dir = Path(summary.run_dir)
    written = json.loads((mission_dir / "run_summary.json").read_text())
    t = written["timing"]
    assert t["tickets"] == 20 and t["global_batches"] == 6  # 10 tickets in batches of 4, 4, 2; two epochs
    # the scripted judge takes milliseconds: the record rounds to 1 ms, so compare loosely
    assert t["loop_s"] > 0 and t["setup_s"] > 0 and t["rollout_s"] <= t["loop_s"] + 0.001
    assert min(t["rollout_s"], t["reflection_s"], t["select_s"], t["wait_for_ranks_s"]) >= 0
    assert t["tickets_per_s"] > 0 and t["tickets_per_s"] * t["loop_s"] == pytest.approx(20, rel=0.2)
    metrics = [json.loads(x) for x in (mission_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("time/reflection_s" in m for m in metrics if m["kind"] == "batch")
    # the manifest covers what is on disk (pruned guidance snapshots stay listed: retention 1, several steps)
    on_disk = {str(p.relative_to(mission_dir)) for p in mission_dir.rglob("*") if p.is_file()}
    assert summary.final_step >= 2 and on_disk <= set(written["files"])
    assert "run_summary.json" in on_disk and len(set(written["files"]) - on_disk) >= 1
