"""Which resource bounds Channel-B in a finished run, and what to add: the runbook's advice as a computed line.

    bound = b_bound(learner_records, actor_records)   # {"bound": "rollout-server" | ..., "advice": ..., ...}

Demand: the B packs the schedule wanted per second of the run (B steps wanted x packs a B step takes).
Supply: the B packs that reached the learner per second (``queue/rank*/received``). When supply covers
demand (within 10 %), B is bound by the learner itself (it trains every B step it wants; extra packs go
stale). Otherwise B is rollout-bound, and the actors' own clocks say where their time went:

    time/rollout                     waiting for the rollout server's /infer      -> rollout-server
    time/parse+match+target+encode   the actor's CPU work per rollout             -> actors
    time/wait_credit                 no credit from the learner to send a pack    -> credits

(sums over every actor's interval records; concurrent /infer calls make ``time/rollout`` exceed wall
time, so only the shares are compared). What this module does not know: how the run was launched.
"""

from __future__ import annotations

import re
from typing import Any

K = "stage2_ab/async/"
CPU_KEYS = ("time/parse", "time/match", "time/target", "time/encode", "time/send")
ADVICE = {
    "learner": "B steps get the packs they want; more rollout capacity would only add stale drops",
    "rollout-server": "actors wait on the rollout server most of their time: add server capacity (GPUs or "
                      "replicas in rollout_matching.vllm.servers) or batch more per call "
                      "(stage2_ab.channel_b.rollout_decode_batch_size)",
    "actors": "actors are busy with their own CPU work (parse, match, targets, encode): add actors "
              "(actor.num_actors_per_rank) or CPU cores",
    "credits": "actors hold finished packs waiting for credits: raise stage2_ab.channel_b.async.queue_limit / "
               "prefetch_target_packs",
}


def b_bound(records: list[dict[str, Any]], actor_records: list[dict[str, Any]], wall_s: float) -> dict[str, Any] | None:
    """The bounding resource of B (module docstring); None without records, time or any wanted B step."""
    wanted = sum(bool(r.get(K + "policy_wants_b")) for r in records)
    if not records or wall_s <= 0 or wanted == 0:
        return None
    b_steps = [r for r in records if r.get(K + "step_kind_b")]
    per_step = (sum(len(v) for r in b_steps for v in r.get(K + "trained_pack_vers", [])) / len(b_steps) if b_steps
                else len(records[-1].get(K + "kinds_by_rank", [0])))
    received = sum(v for k, v in records[-1].items() if re.fullmatch(r"queue/rank\d+/received", k))
    demand, supply = wanted * per_step / wall_s, received / wall_s
    times = {"rollout-server": 0.0, "actors": 0.0, "credits": 0.0}
    for r in actor_records:
        if r.get("event") == "final":
            continue
        times["rollout-server"] += float(r.get("time/rollout", 0.0) or 0.0)
        times["actors"] += sum(float(r.get(k, 0.0) or 0.0) for k in CPU_KEYS)
        times["credits"] += float(r.get("time/wait_credit", 0.0) or 0.0)
    total = sum(times.values())
    shares = {k: v / total for k, v in times.items()} if total > 0 else {}
    if supply >= 0.9 * demand or not shares:
        bound = "learner" if supply >= 0.9 * demand else "rollout-server"
    else:
        bound = max(shares, key=shares.__getitem__)
    return {"bound": bound, "advice": ADVICE[bound], "b_packs_wanted_per_s": demand, "b_packs_received_per_s": supply,
            "actor_time_shares": shares}


def format_bound(b: dict[str, Any] | None) -> str | None:
    if b is None:
        return None
    shares = ", ".join(f"{k} {v:.0%}" for k, v in b["actor_time_shares"].items())
    return (f"B bound by             {b['bound']}: packs received {b['b_packs_received_per_s']:.2f}/s vs wanted "
            f"{b['b_packs_wanted_per_s']:.2f}/s; actor time: {shares or 'n/a'}\n"
            f"                       -> {b['advice']}")


__all__ = ["b_bound", "format_bound"]
