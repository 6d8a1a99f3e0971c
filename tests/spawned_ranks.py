"""Two (or more) spawned ranks for a distributed test: started by handle, joined under one deadline, any rank
still running killed by its handle, then each rank's result file read.

    results = run_ranks(_rank_main, lambda r: (r, port, str(tmp_path)), out_dir=tmp_path, deadline_s=120,
                        hang_hint="a collective hung without its deadline")

Each rank writes ``out_dir/rank<r>.json`` (``{"ok": true, ...}`` or ``{"error": traceback}``) before it exits.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_ranks(target: Callable[..., None], args_of: Callable[[int], tuple], *, out_dir: Path, deadline_s: float,
              hang_hint: str, crash_hint: str = "it crashed before writing its result", world: int = 2
              ) -> dict[int, dict[str, Any]]:
    """Run ``target(*args_of(r))`` for r in 0..world-1 in spawned processes; every rank's result, each checked
    to have finished, written its file and reported no error (assertions name the rank and the likely cause)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(r), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + deadline_s
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()  # only the processes this test started, by their handle
    assert not alive, f"ranks {alive} still running after {deadline_s:g} s: {hang_hint}"
    results = {}
    for r in range(world):
        path = Path(out_dir) / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result (exit code {procs[r].exitcode}): {crash_hint}"
        results[r] = json.loads(path.read_text())
        assert results[r].get("ok", "error" not in results[r]), f"rank {r}:\n{results[r].get('error')}"
    return results
