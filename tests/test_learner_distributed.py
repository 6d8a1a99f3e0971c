"""The learner's collectives and step decision on 2 real gloo ranks (spawned processes, no model).

Each rank writes its observations to ``rank<r>.json``; the parent joins with a deadline and merges.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from fractions import Fraction
from pathlib import Path

import pytest

from tests.ports import free_port_block

JOIN_DEADLINE_S = 90


class _Queue:
    def __init__(self, n: int) -> None:
        self.n, self.reserved = n, 0

    def eligible(self) -> int:
        return self.n

    def reserve(self, k: int) -> list:
        self.reserved += k
        return [f"pack{i}" for i in range(k)]


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    from learner.decision import decide_step
    from learner.distributed import CollectiveTimeout, Dist

    result: dict = {"rank": rank}
    dist = Dist("gloo", timeout_s=3.0)
    try:
        result["min"] = dist.all_reduce([rank + 1, 10 - rank], "min", "test min")
        result["sum"] = dist.all_reduce([rank + 1], "sum", "test sum")
        result["bcast"] = dist.broadcast([7 if rank == 0 else -1, rank], "test broadcast")
        result["gather"] = dist.all_gather([rank, rank * 2], "test gather")
        short = _Queue(5 if rank == 0 else 1)  # rank 1 holds fewer than GA = 2
        d = decide_step(1, Fraction(1, 2), 2, short, dist)
        result["short"] = [d.kind, d.policy_wants_b, d.skipped_due_to_queue, short.reserved, d.min_eligible]
        full = _Queue(5 if rank == 0 else 3)
        d = decide_step(3, Fraction(1, 2), 2, full, dist)
        result["full"] = [d.kind, d.policy_wants_b, d.skipped_due_to_queue, full.reserved, len(d.packs)]
        # rank 1 is "stuck elsewhere": rank 0's barrier must time out with a message, not hang
        if rank == 0:
            t0 = time.monotonic()
            try:
                dist.barrier("the test barrier at step 12")
                result["timeout"] = None
            except CollectiveTimeout as exc:
                result["timeout"] = str(exc)
            result["waited_s"] = time.monotonic() - t0
        else:  # stay alive (not in the barrier) until rank 0 has seen its timeout
            done = Path(out_dir, "rank0.json")
            limit = time.monotonic() + 30
            while not done.exists() and time.monotonic() < limit:
                time.sleep(0.05)
    except BaseException as exc:  # recorded for the parent's message
        result["error"] = repr(exc)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # skip destroy_process_group: the peer may be gone after the timeout


@pytest.mark.slow
def test_collectives_and_the_decision_agree_on_two_ranks_and_a_stuck_peer_times_out_with_a_named_wait(tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port_block(1)
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(tmp_path)), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_DEADLINE_S
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()  # only the processes this test started, by their handle
    assert not alive, f"ranks {alive} still running after {JOIN_DEADLINE_S}s: a collective hung without its deadline"
    results = {}
    for r in (0, 1):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result (exit code {procs[r].exitcode}): it crashed before the end"
        results[r] = json.loads(path.read_text())
        assert "error" not in results[r], f"rank {r}: {results[r]['error']}"
    r0, r1 = results[0], results[1]
    assert r0["min"] == r1["min"] == [1, 9] and r0["sum"] == r1["sum"] == [3]
    assert r0["bcast"] == r1["bcast"] == [7, 0]
    assert r0["gather"] == r1["gather"] == [[0, 0], [1, 2]]
    # policy wants B at step 1, rank 1 is short: both ranks run A, nobody reserves, the skip is flagged
    assert r0["short"] == r1["short"] == ["A", True, True, 0, 1]
    # step 3: both hold >= GA: B on both ranks, each reserves GA packs
    assert r0["full"] == r1["full"] == ["B", True, False, 2, 2]
    assert r0["timeout"] and "the test barrier at step 12" in r0["timeout"] and "rank 0/2" in r0["timeout"]
    assert "collective_timeout_s=3s" in r0["timeout"] and "another rank died or is stuck" in r0["timeout"]
    assert 2.5 <= r0["waited_s"] < 30
