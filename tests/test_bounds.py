"""``launcher/bounds.py``: the summary's "B bound by" line from a run's own learner and actor records."""

from __future__ import annotations

import pytest

from launcher.bounds import b_bound, format_bound

K = "stage2_ab/async/"


def learner(wanted: int, b_steps: int, received: int, world: int = 2, ga: int = 2) -> list[dict]:
    recs = [{K + "policy_wants_b": i < wanted, K + "step_kind_b": i < b_steps,
             K + "trained_pack_vers": [[1] * ga] * world if i < b_steps else [[]] * world,
             K + "kinds_by_rank": ["B" if i < b_steps else "A"] * world} for i in range(100)]
    recs[-1].update({f"queue/rank{r}/received": received // world for r in range(world)})
    return recs


def actor(rollout: float, cpu: float, credit: float) -> list[dict]:
    one = {"event": "metrics", "time/rollout": rollout / 2, "time/parse": cpu / 4, "time/encode": cpu / 4,
           "time/wait_credit": credit / 2}
    return [one, dict(one), {"event": "final", "time/rollout": 1e6}]  # the final record repeats totals: not summed


@pytest.mark.parametrize("times, bound", [((90.0, 5.0, 5.0), "rollout-server"), ((10.0, 80.0, 10.0), "actors"),
                                          ((10.0, 10.0, 80.0), "credits")])
def test_a_rollout_bound_run_names_where_the_actors_time_went(times, bound):
    b = b_bound(learner(wanted=50, b_steps=10, received=40), actor(*times), wall_s=100.0)
    assert b["bound"] == bound and b["b_packs_wanted_per_s"] == pytest.approx(50 * 4 / 100)
    assert b["b_packs_received_per_s"] == pytest.approx(0.4)
    assert sum(b["actor_time_shares"].values()) == pytest.approx(1.0)
    line = format_bound(b)
    assert bound in line and "0.40/s vs wanted 2.00/s" in line and "->" in line


def test_packs_arriving_as_fast_as_b_wants_them_make_the_learner_the_bound():
    b = b_bound(learner(wanted=50, b_steps=50, received=200), actor(90.0, 5.0, 5.0), wall_s=100.0)
    assert b["bound"] == "learner" and "stale" in b["advice"]


def test_no_wanted_b_step_or_no_time_gives_no_line():
    assert b_bound(learner(wanted=0, b_steps=0, received=0), actor(1, 1, 1), wall_s=100.0) is None
    assert b_bound(learner(wanted=5, b_steps=0, received=0), [], wall_s=0.0) is None
    assert format_bound(None) is None
