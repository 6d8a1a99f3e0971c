"""An abort-mode fence cuts a batch at most once, so syncs that come faster than a batch runs cannot starve it.

The storm here is what 4 x H200 showed (docs/benchmarks.md section 16): a learner syncing every ~2.5 s while a
batch needed longer, every fence cutting the same batches, zero rollouts finished. Scaled down: batches of
0.2 s, a sync every 0.05 s.
"""

from __future__ import annotations

import asyncio

from rollout_server import fence as fence_mod
from rollout_server.fence import Fence

WORK_S = 0.2
SYNC_EVERY_S = 0.05


async def _storm(fence: Fence, stop: asyncio.Event, log: list[tuple[int, int]]) -> None:
    """Abort-mode syncs back to back: close, cut what may be cut, wait for the rest, reopen at ver + 1."""
    while not stop.is_set():
        await fence.close()
        cut = fence.abort_inflight()
        await fence.wait_quiet(timeout_s=5)
        await fence.open(fence.ver + 1)
        log.append((fence.ver, cut))
        await asyncio.sleep(SYNC_EVERY_S)


async def _batches(fence: Fence, n: int, storm_s: float) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """``n`` batches under a storm of ``storm_s`` seconds: (ver, attempts) of each finished one, the syncs, and
    how many were still running when the storm ended."""
    stop, syncs = asyncio.Event(), []
    storm = asyncio.create_task(_storm(fence, stop, syncs))

    async def batch() -> tuple[int, int]:
        attempts = 0

        async def work() -> int:
            nonlocal attempts
            attempts += 1
            await asyncio.sleep(WORK_S)
            return attempts

        ticket, _ = await fence.run(work, timeout_s=10)
        return ticket.ver, attempts

    await asyncio.sleep(0.01)  # the first sync's fence is open again: batches start between syncs
    tasks = [asyncio.create_task(batch()) for _ in range(n)]
    done, pending = await asyncio.wait(tasks, timeout=storm_s)
    stop.set()
    await storm
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() for t in done], syncs, len(pending)


def test_a_batch_cut_once_is_drained_by_the_next_fence_and_finishes_under_a_sync_storm():
    fence = Fence()
    finished, syncs, running = asyncio.run(_batches(fence, n=4, storm_s=2.0))
    assert running == 0 and len(finished) == 4, f"{running} of 4 batches never finished under {len(syncs)} syncs"
    assert all(attempts <= 1 + fence_mod.MAX_CUTS for _, attempts in finished), finished
    assert fence.reruns >= 1, "no batch was cut: the storm did not exercise the abort fence"
    assert fence.spared >= 1, "no re-run was drained: the bound was not exercised"
    served = {ver for ver, _ in syncs} | {0}
    assert all(ver in served for ver, _ in finished), (finished, syncs)  # each tagged with a ver that was served


def test_without_the_bound_the_same_storm_finishes_no_batch(monkeypatch):
    """The hazard the bound removes (so the test above is not passing by accident)."""
    monkeypatch.setattr(fence_mod, "MAX_CUTS", 10**9)
    fence = Fence()
    finished, syncs, running = asyncio.run(_batches(fence, n=4, storm_s=1.0))
    assert finished == [] and running == 4, finished
    assert fence.reruns >= 4 * 3 and fence.spared == 0, (fence.reruns, fence.spared, len(syncs))


def test_a_sync_that_drains_a_rerun_batch_says_so_in_its_begin_response(tiny_model_dir):
    """``SyncBeginResponse.spared``: the second of two abort-mode syncs meets the batch the first one cut, drains it
    (MAX_CUTS) and reports it, so a long fence in a learner's metrics (``sync/fence_spared``) names its cause."""
    from common.weight_sync.messages import SyncAbortRequest, SyncBeginRequest, SyncInitRequest
    from rollout_server.engines.hf import HFEngine
    from rollout_server.weight_sync.session import SyncController

    async def main() -> list:
        engine = HFEngine(str(tiny_model_dir), device="cpu")
        await engine.start()
        fence = Fence()
        sync = SyncController(engine, fence, idle_timeout_s=60)
        started = asyncio.Event()

        async def work() -> None:
            started.set()
            await asyncio.sleep(WORK_S)

        batch = asyncio.create_task(fence.run(work, timeout_s=10))
        replies = []
        for _ in range(2):
            await started.wait()
            started.clear()
            opened = await sync.init(SyncInitRequest(client="test", transport="http"))
            replies.append(await sync.begin(SyncBeginRequest(session=opened.session, mode="abort", timeout_s=10)))
            await sync.abort(SyncAbortRequest(session=opened.session, reason="test"))
        ticket, _ = await batch
        return [replies, ticket.cuts]

    (first, second), cuts = asyncio.run(main())
    assert (first.aborted, first.spared) == (1, 0), first
    assert (second.aborted, second.drained, second.spared) == (0, 1, 1), second
    assert cuts == fence_mod.MAX_CUTS
    assert second.fence_s >= WORK_S / 2, "the second fence waited for the re-run: the wait spared reports"
