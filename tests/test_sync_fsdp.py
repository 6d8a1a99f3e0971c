"""Weight sync from an FSDP2-sharded learner: 2 real gloo ranks under ``torchrun``, real rollout servers (hf engine).

Each scenario is one ``torchrun --nproc_per_node=2`` of this file as a worker (``--worker land|fail``):
the tiny model sharded by ``learner.parallel.wrap`` (``learner.parallel: fsdp``), trained a step so its
weights differ from the server's, then synced by the learner's own ``WeightSync`` on both ranks. Each
rank writes ``rank<r>.json``; the parent runs the ranks under a deadline (a deadlock fails the test
with the ranks' log instead of hanging) and asserts on the merged results. Expected digests are
computed independently of the sync code: torch's own full state dict (``get_model_state_dict``),
cast to the server's manifest, hashed with ``exact_digest``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # when torchrun runs this file as a rank worker
    sys.path.insert(0, str(REPO))

#: The ``adapter`` scenario's recipe (config overrides): DoRA on every linear layer outside the frozen vision tower.
ADAPTER_RECIPE = ["model.adapter={type: dora, rank: 4, alpha: 8, target_modules: all-linear}", "model.freeze=[vision]"]
RUN_DEADLINE_S = 240.0  # one torchrun of 2 ranks on a shared 2-core box; a hang fails the test, not the suite
SMALL_BUCKET = 256 << 10  # several buckets for the 3.3 MB tiny model


# ----------------------------------------------------------------------------------------------- rank worker


@contextlib.contextmanager
def rank_result(dist, out: str):
    """The rank's result dict, written to ``out/rank<r>.json`` whatever happens (a traceback under ``error``);
    on success the ranks' closing all-reduce (``aligned``) first. Used by tests/test_sync_fsdp_adapter.py too."""
    result: dict = {"rank": dist.rank}
    try:
        yield result
        result["aligned"] = dist.all_reduce([1], "sum", "the test's closing all-reduce")[0]
    except BaseException as exc:
        import traceback

        result["error"] = traceback.format_exc()
        raise SystemExit(f"rank {dist.rank}: {exc}") from exc
    finally:
        Path(out, f"rank{dist.rank}.json").write_text(json.dumps(result))
        dist.close()


def leave_after(worker, argv: list[str]) -> None:
    """Run a rank's ``worker(argv)``, then exit without interpreter finalization: a rank's gloo group can outlive
    ``destroy_process_group`` and abort the exit ("terminate called without an active exception", seen under a
    loaded full suite) after every result was written (as in tests/test_load_plan.py)."""
    code = 0
    try:
        worker(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        if exc.code and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported, then the exit code says it
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _worker(args: list[str]) -> None:
    import argparse

    import torch

    from common.config.load import load_config
    from learner.distributed import Dist
    from learner.parallel import wrap

    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["land", "fail", "adapter"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--url", action="append", required=True)
    ap.add_argument("--kill-pid", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cuda: the GPU test (tests/test_gpu_weight_sync.py), 1 rank")
    ap.add_argument("--offload", action="store_true", help="learner.fsdp.cpu_offload")
    ap.add_argument("--transports", default="http,ipc,nccl", help="the blocking pushes of scenario land")
    ap.add_argument("--overlap-transport", default="http")
    a = ap.parse_args(args)
    import logging

    logging.basicConfig(level=logging.INFO, format=f"rank %(process)d %(name)s: %(message)s")
    cuda = a.device == "cuda"
    dist = Dist("nccl" if cuda else "gloo", timeout_s=120)
    with rank_result(dist, a.out) as result:
        def config(urls: list[str], transport: str = "http", mode: str = "blocking"):
            servers = ",".join(f"{{base_url: '{u}'}}" for u in urls)
            return load_config(REPO / "configs/demo_cpu.yaml", [
                f"model.path={a.model}", f"rollout_matching.vllm.servers=[{servers}]", "learner.parallel=fsdp",
                f"weight_sync.transport={transport}", "weight_sync.timeout_s=30",
                "weight_sync.bucket_mb=1", f"weight_sync.mode={mode}",
                f"learner.fsdp.cpu_offload={str(a.offload).lower()}", "learner.collective_timeout_s=120",
                f"learner.nproc_per_node={dist.world_size}", *ADAPTER_RECIPE * (a.scenario == "adapter")],
                world_size=dist.world_size)

        from transformers import AutoModelForImageTextToText

        cfg = config(a.url)
        device = torch.device("cuda", dist.local_rank) if cuda else torch.device("cpu")
        model = AutoModelForImageTextToText.from_pretrained(a.model, dtype=torch.float32).to(device)
        if a.scenario == "adapter":
            from learner.recipe import apply_recipe

            apply_recipe(model, cfg.model)  # as learner/model.py does, before the wrap
        model = wrap(model, cfg.learner, device, dist.world_size, dist.local_rank)
        trainer = _Trainer(model, dist.rank, device)
        {"land": _land, "fail": _fail, "adapter": _adapter}[a.scenario](a, dist, model, trainer, config, result)


class _Trainer:
    """One AdamW step on a text batch that differs per rank (so the gradient reduction matters)."""

    def __init__(self, model, rank: int, device) -> None:
        import torch

        self.model, self.rank, self.device = model, rank, device
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.steps = 0
        self.guard = lambda: None  # the learner's WeightSync.before_weights_change (a GPU snapshot's copy first)

    def step(self) -> None:
        import torch

        g = torch.Generator().manual_seed(100 * self.steps + self.rank)
        ids = torch.randint(0, 1000, (2, 12), generator=g).to(self.device)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.guard()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1


def _served(url: str) -> dict:
    """The server's ver and exact digest (rank 0 only)."""
    import httpx

    from common.weight_sync.messages import SyncDigestResponse

    r = httpx.get(url + "/sync/digest", timeout=60)
    r.raise_for_status()
    d = SyncDigestResponse.model_validate_json(r.content)
    return {"ver": d.ver, "digests": d.digests}


def _expected(model, dist, url: str) -> dict | None:
    """Every rank (a collective): torch's full state dict; rank 0 digests it as the server would hold it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from common.weight_sync import weights as W
    from learner.weight_sync.base import cast_stream, plan
    from learner.weight_sync.session import SyncClient

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_main:
        return None
    client = SyncClient(url, timeout_s=30)
    try:
        session = client.open(1 << 20)  # for the manifest (names, tied groups, serving dtype)
        session.abort("the test only wanted the manifest")
    finally:
        client.close()
    planned = plan(session.info, full.items())
    return {"digest": W.exact_digest(cast_stream(session.info, planned)), "n_served": len(planned),
            "fingerprint": W.fingerprint(planned, {s.name: s.dtype for s in session.info.manifest})}


def _land(a, dist, model, trainer, config, result) -> None:
    """Blocking pushes over http, ipc and nccl (gloo on CPU), each after a step; then one overlap push."""
    from learner.weight_sync.boundary import WeightSync

    url, ver, step = a.url[0], 0, 0
    for transport in a.transports.split(","):
        trainer.step()
        step += 1
        sync = WeightSync(config(a.url, transport), dist)
        sync.bucket_bytes = SMALL_BUCKET
        t0 = time.monotonic()
        out = sync.run(model, step, ver)
        ver = out.ver
        entry = {"ok": out.ok, "ver": out.ver, "gathers": sync.gathers, "s": time.monotonic() - t0}
        expected = _expected(model, dist, url)
        if dist.is_main:
            entry.update(served=_served(url), expected=expected)
        result[transport] = entry
        sync.close()
    # Overlap: the start-up sync blocks; at a later due boundary each rank copies its own shards and rank 0's push
    # thread receives the others' (a gloo side group) and pushes, while every rank trains on.
    sync = WeightSync(config(a.url, a.overlap_transport, mode="overlap"), dist, progress=lambda: step)
    sync.bucket_bytes = SMALL_BUCKET
    trainer.guard = sync.before_weights_change
    ver = sync.boundary(model, step, ver).ver  # start-up (blocking)
    result["prepared_at_start"] = sync.shards is not None and sync.shards.ready  # host buffers before any push

    def overlap_push() -> dict:
        nonlocal step
        trainer.step()
        step += sync.every
        gathers_before, moved_before = sync.gathers, sync.shards.moved if sync.shards else 0
        at_snapshot = _expected(model, dist, url)  # before the push holds the server's one sync session
        started = sync.boundary(model, step, ver)
        trainer.step()  # the weights move on while the push runs: the server must get the snapshot's
        settled = sync.settle(model, step, ver, "the test")
        entry = {"started": started.metrics.get("sync/started"), "ok": settled.ok, "ver": settled.ver,
                 "ver_before": ver, "gathers": sync.gathers - gathers_before,
                 "moved": sync.shards.moved - moved_before, "broken": sync.shards.broken}
        after = _expected(model, dist, url)
        if dist.is_main:
            entry.update(served=_served(url), expected=at_snapshot, moved_on=after)
        return entry

    result["overlap"] = entry = overlap_push()
    ver = entry["ver"]
    if dist.world_size == 1:  # nothing to receive from another rank
        sync.close()
        return
    # Rank 1's shards never come: rank 0's receive misses its deadline and the push fails; the next boundary's
    # broadcast tells every rank, and the push after it gathers on the training path and lands.
    sync.shards.timeout_s = 3.0
    if not dist.is_main:
        sync.shards._start_sender = lambda: None
    result["overlap_unsent"] = overlap_push()
    result["overlap_after"] = overlap_push()
    sync.close()
    result["uneven"] = _uneven_shards(dist, trainer.device)


def _uneven_shards(dist, device) -> dict:
    """Parameters of 3, 1 and 5 rows over 2 ranks (2 + 1, 1 + 0, 3 + 2 rows) and one every rank holds whole:
    rank 0 assembles each equal to torch's own ``full_tensor``."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from learner.weight_sync.shard_snapshot import ShardSnapshot

    torch.manual_seed(0)
    toy = torch.nn.Module()
    toy.a, toy.b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(1, 4))
    toy.c = torch.nn.Parameter(torch.randn(5))
    fully_shard(toy.to(device))
    whole = torch.arange(6.0, device=device).reshape(2, 3)
    named = [(n, p.detach()) for n, p in toy.named_parameters()] + [("whole", whole)]
    shards = ShardSnapshot(dist, 30.0)
    assert shards.take(named), "a dim-0 shard on a 1-D mesh is the supported layout"
    got = shards.assemble() if dist.is_main else []
    full = [t.full_tensor() if hasattr(t, "full_tensor") else t for _, t in named]  # a collective: every rank
    shards.close()
    return {"rows": [list(t.to_local().shape[:1]) for n, t in named if n != "whole"], "moved": shards.moved,
            "equal": [torch.equal(g, f.cpu()) for (_, g), f in zip(got, full)]}


def _fail(a, dist, model, trainer, config, result) -> None:
    """A bucket the server refuses mid-push (http: 413), then a server killed after the fence while the NCCL
    sender's thread gathers and broadcasts (gloo on CPU; the next server gets an empty plan); every rank returns."""
    from learner.weight_sync.boundary import WeightSync

    refusing, doomed = a.url
    trainer.step()
    for name, urls, transport in (("refused", [refusing], "http"), ("killed", [doomed, refusing], "nccl")):
        sync = WeightSync(config(urls, transport), dist)
        sync.bucket_bytes = SMALL_BUCKET
        if dist.is_main and name == "killed":
            sender = sync._sender(doomed)
            push = sender.push
            sender.push = lambda *p, **kw: push(*p, on_phase=lambda _: os.kill(a.kill_pid, signal.SIGKILL), **kw)
        before = _served(refusing) if dist.is_main else None
        t0 = time.monotonic()
        out = sync.run(model, step=1, ver=0)
        import threading

        result[name] = {"ok": out.ok, "ver": out.ver, "gathers": sync.gathers, "s": time.monotonic() - t0,
                        "failures": sync.counts["sync/failures"],
                        "sync_threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("wsync"))}
        if dist.is_main:
            result[name].update(before=before, after=_served(refusing))
        sync.close()
        import gc

        from common.weight_sync.weights import TorchTransferGroup  # released at once, not at a random collection later
        result[name]["groups_alive"] = sum(isinstance(o, TorchTransferGroup) for o in gc.get_objects())
    if dist.is_main:  # the refusal was mid-push: the first bucket over the server's 1 MB cap is not the first
        from common.weight_sync import packed as P
        from learner.weight_sync.session import SyncClient

        client = SyncClient(refusing, timeout_s=30)
        session = client.open(1 << 20)
        session.abort("the test only wanted the manifest")
        client.close()
        dtypes = {s.name: s.dtype for s in session.info.manifest}
        import torch

        planned = [(s.name, torch.empty(s.shape, device="meta")) for s in session.info.manifest]
        sizes = [P.nbytes_of(b) for b in P.bucket_plan(planned, dtypes, SMALL_BUCKET)]
        result["first_refused_bucket"] = next(k for k, n in enumerate(sizes) if n > 1 << 20)
        result["n_buckets"], result["n_served"] = len(sizes), len(planned)


def _expected_merged(model, dist, cfg, model_dir: str, url: str) -> dict | None:
    """Every rank (a collective): torch's full state dict of the sharded adapter policy; rank 0 loads it into a
    fresh policy with the same adapter, merges each adapted layer in place with peft's own ``merge``, and digests
    the served names as the server would hold them (independent of the push's gather-and-merge path)."""
    from peft.tuners.lora import LoraLayer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForImageTextToText

    from common.weight_sync import weights as W
    from learner.recipe import apply_recipe, hf_name
    from learner.weight_sync.base import cast_stream, plan
    from learner.weight_sync.session import SyncClient

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_main:
        return None
    fresh = AutoModelForImageTextToText.from_pretrained(model_dir)
    apply_recipe(fresh, cfg.model)
    fresh.load_state_dict(full)
    layers = [m for m in fresh.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer.merge(safe_merge=True)
    merged = [(hf_name(n), p.detach()) for n, p in fresh.named_parameters()
              if ".lora_" not in n and ".original_module." not in n]
    client = SyncClient(url, timeout_s=30)
    try:
        session = client.open(1 << 20)
        session.abort("the test only wanted the manifest")
    finally:
        client.close()
    planned = plan(session.info, merged)
    dora = sum(bool(layer.use_dora.get("default")) for layer in layers)
    return {"digest": W.exact_digest(cast_stream(session.info, planned)), "n_served": len(planned),
            "n_parts": len(planned) + 2 * len(layers) + dora}


def _adapter(a, dist, model, trainer, config, result) -> None:
    """A DoRA policy sharded by FSDP2, ``model.adapter.sync: merged``: a blocking push after a step, then an overlap
    push whose snapshot (each rank's shards, assembled and merged by rank 0's push thread) must land although
    training moves on."""
    from learner.weight_sync.boundary import WeightSync

    url, step = a.url[0], 1
    frozen = {n: p.detach().to_local().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer.step()
    sync = WeightSync(config(a.url), dist)
    sync.bucket_bytes = SMALL_BUCKET
    out = sync.run(model, step, 0)
    expected = _expected_merged(model, dist, config(a.url), a.model, url)
    result["blocking"] = {"ok": out.ok, "ver": out.ver, "gathers": sync.gathers}
    if dist.is_main:
        result["blocking"].update(served=_served(url), expected=expected)
    sync.close()
    sync = WeightSync(config(a.url, mode="overlap"), dist, progress=lambda: step)
    sync.bucket_bytes = SMALL_BUCKET
    trainer.guard = sync.before_weights_change
    ver = sync.boundary(model, step, out.ver).ver  # the start-up push (blocking)
    trainer.step()
    step += sync.every
    gathers_before = sync.gathers
    at_snapshot = _expected_merged(model, dist, config(a.url), a.model, url)
    started = sync.boundary(model, step, ver)
    trainer.step()  # the weights move on while the push runs: the server must get the snapshot's merge
    settled = sync.settle(model, step, ver, "the test")
    result["overlap"] = {"started": started.metrics.get("sync/started"), "ok": settled.ok, "ver": settled.ver,
                         "ver_before": ver, "gathers": sync.gathers - gathers_before, "moved": sync.shards.moved}
    if dist.is_main:
        result["overlap"].update(served=_served(url), expected=at_snapshot)
    sync.close()
    import torch

    result["frozen_unchanged"] = bool(frozen) and all(
        torch.equal(frozen[n], p.detach().to_local()) for n, p in model.named_parameters() if n in frozen)


if __name__ == "__main__" and "--worker" in sys.argv:
    leave_after(_worker, [x for x in sys.argv[1:] if x != "--worker"])


# ----------------------------------------------------------------------------------------------- the tests


def test_the_running_fingerprint_equals_the_one_shot_fingerprint_of_the_cast_weights(tiny_model_dir):
    import torch
    from transformers import AutoModelForImageTextToText

    from common.weight_sync import weights as W
    from learner.weight_sync.sharded import RunningFingerprint

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    dtypes = {n: "bfloat16" for n, _ in named}
    running = RunningFingerprint()
    for name, t in reversed(named):  # any order: the hash is over names sorted
        running.add(name, t.to(torch.bfloat16))
    assert any(t.numel() > W.FINGERPRINT_SAMPLES for _, t in named) and any(t.numel() < 100 for _, t in named)
    assert running.hexdigest() == W.fingerprint(named, dtypes) != W.fingerprint(named)


def _run(tmp: Path, scenario: str, urls: list[str], model_dir: Path, extra: list[str] = (), nproc: int = 2,
         env: dict[str, str] | None = None, script: str = __file__) -> list[dict]:
    """One torchrun of ``nproc`` worker ranks of ``script`` (``--worker``) under the deadline; their merged results
    (AssertionError on a failure)."""
    from tests.test_learner_harness import Proc

    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
            "--worker", scenario, "--out", str(tmp), "--model", str(model_dir), *[f"--url={u}" for u in urls], *extra]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # keep a staged site dir
    proc = Proc(argv, tmp / "torchrun.log", env={"OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})})
    rc = proc.wait(RUN_DEADLINE_S, f"torchrun of {nproc} fsdp rank(s) ({scenario})")
    proc.stop()
    results = [json.loads(p.read_text()) if (p := tmp / f"rank{r}.json").exists() else {} for r in range(nproc)]
    errors = [r.get("error") for r in results if r.get("error")]
    assert rc == 0 and not errors, f"torchrun exited {rc}; rank errors: {errors}\n{proc.tail(80)}"
    return results


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """The ``land`` and ``adapter`` scenarios' server (a push asks for ver + 1 at least; the server takes the larger)."""
    from tests.server_proc import rollout_server_process

    with rollout_server_process(tiny_model_dir, []) as srv:
        yield srv


@pytest.fixture(scope="module")
def landed(server, tiny_model_dir, tmp_path_factory):
    t0 = time.monotonic()
    results = _run(tmp_path_factory.mktemp("fsdp-land"), "land", [server.url], tiny_model_dir)
    print(f"fsdp land scenario: {time.monotonic() - t0:.1f}s")
    return results


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["http", "ipc", "nccl"])
def test_a_sharded_learner_lands_its_weights_bit_exact_in_the_server(landed, transport):
    r0, r1 = landed
    push = r0[transport]
    assert push["ok"] and r1[transport]["ok"] and push["ver"] == r1[transport]["ver"] == push["served"]["ver"]
    assert push["served"]["digests"] == [push["expected"]["digest"]], "the served weights are not the learner's"
    earlier = [r0[t]["expected"]["digest"] for t in ("http", "ipc", "nccl") if t != transport]
    assert push["expected"]["digest"] not in earlier, "each push must carry new weights (a step between pushes)"


@pytest.mark.slow
def test_every_rank_gathers_each_served_tensor_exactly_once_per_push(landed):
    r0, r1 = landed
    n = r0["http"]["expected"]["n_served"]
    for transport in ("http", "ipc", "nccl"):
        assert r0[transport]["gathers"] == r1[transport]["gathers"] == n, transport
    assert r0["aligned"] == r1["aligned"] == 2


@pytest.mark.slow
def test_an_overlap_push_under_fsdp_moves_each_ranks_shards_beside_training_and_lands_them(landed):
    r0, r1 = landed
    o0, o1 = r0["overlap"], r1["overlap"]
    assert o0["started"] == o1["started"] == 1
    assert o0["ok"] and o1["ok"] and o0["ver"] == o1["ver"] == o0["ver_before"] + 1 == o0["served"]["ver"]
    assert o0["served"]["digests"] == [o0["expected"]["digest"]] != [o0["moved_on"]["digest"]]
    assert o0["gathers"] == o1["gathers"] == 0, "no all-gather on the training path"
    assert o0["moved"] == o1["moved"] > 0, "rank 0 received every shard rank 1 sent"
    assert r0["prepared_at_start"] and r1["prepared_at_start"], "the start-up sync pinned the host buffers"


@pytest.mark.slow
def test_shards_that_never_come_fail_that_push_and_later_pushes_gather_on_the_training_path(landed):
    r0, r1 = landed
    unsent, after = r0["overlap_unsent"], r0["overlap_after"]
    assert unsent["started"] == 1 and not unsent["ok"] and not r1["overlap_unsent"]["ok"]
    assert unsent["ver"] == r1["overlap_unsent"]["ver"] == unsent["ver_before"], "a failed push keeps the ver"
    assert unsent["moved"] == r1["overlap_unsent"]["moved"] == 0 and unsent["broken"]
    assert after["ok"] and r1["overlap_after"]["ok"] and after["ver"] == unsent["ver"] + 1 == after["served"]["ver"]
    assert after["served"]["digests"] == [after["expected"]["digest"]], "the gathered fallback lands exact weights"
    n = r0["http"]["expected"]["n_served"]
    assert after["gathers"] == r1["overlap_after"]["gathers"] == n and r1["overlap_after"]["broken"]


@pytest.mark.slow
def test_uneven_and_empty_shards_are_assembled_equal_to_torchs_full_tensor(landed):
    r0, r1 = landed
    assert [r0["uneven"]["rows"], r1["uneven"]["rows"]] == [[[2], [1], [3]], [[1], [0], [2]]]
    assert r0["uneven"]["equal"] == [True] * 4
    assert r0["uneven"]["moved"] == r1["uneven"]["moved"] == 2, "rank 1's two non-empty shards, nothing for 0 rows"


@pytest.mark.slow
def test_a_push_failing_mid_way_leaves_both_ranks_alive_on_the_old_ver(tiny_model_dir, tmp_path):
    from tests.server_proc import rollout_server_process, start_server, wait_healthy

    doomed = start_server(tiny_model_dir, [])
    try:
        cap = ["rollout_server.max_bucket_mb=1", "weight_sync.bucket_mb=1"]  # bodies over 1 MB: 413
        with rollout_server_process(tiny_model_dir, cap) as refusing:
            wait_healthy(doomed)
            t0 = time.monotonic()
            r0, r1 = _run(tmp_path, "fail", [refusing.url, doomed.url], tiny_model_dir,
                          [f"--kill-pid={doomed.proc.pid}"])
            elapsed = time.monotonic() - t0
    finally:
        doomed.stop()
        doomed.log_path.unlink(missing_ok=True)
    assert 0 < r0["first_refused_bucket"] < r0["n_buckets"], "the refusal must come after accepted buckets"
    for name in ("refused", "killed"):
        assert not r0[name]["ok"] and not r1[name]["ok"] and r0[name]["ver"] == r1[name]["ver"] == 0, name
        assert r0[name]["failures"] == r1[name]["failures"] == 1, name
        assert r0[name]["after"] == r0[name]["before"], f"{name}: the server must keep its old weights and ver"
        assert r0[name]["sync_threads"] == r1[name]["sync_threads"] == [], f"{name}: a failed push leaves no thread"
        assert r0[name]["groups_alive"] == 0, f"{name}: the dropped transfer group must be freed when dropped"
    # rank 0 drove every announced gather although sending stopped, and rank 1 took part in each one; the server
    # after the killed one got an empty plan (no gathers) and was not pushed to
    for name in ("refused", "killed"):
        assert r0[name]["gathers"] == r1[name]["gathers"] == r0["n_served"], name
    assert doomed.proc.poll() is not None, "the second scenario must have killed its server mid-push"
    assert r0["aligned"] == r1["aligned"] == 2
    print(f"fsdp fail scenarios: {elapsed:.1f}s")


@pytest.mark.slow
def test_a_sharded_adapter_policy_pushes_its_merged_weights_bit_exact_and_keeps_its_base(server, tiny_model_dir,
                                                                                        tmp_path):
    """``model.adapter.sync: merged`` under FSDP2: every rank gathers each adapted layer's base and adapter, rank 0
    merges them (peft's math) and pushes; the server's digest equals peft's own in-place merge of the full state."""
    r0, r1 = _run(tmp_path, "adapter", [server.url], tiny_model_dir)
    for mode in ("blocking", "overlap"):
        push = r0[mode]
        assert push["ok"] and r1[mode]["ok"] and push["ver"] == r1[mode]["ver"] == push["served"]["ver"], mode
        assert push["served"]["digests"] == [push["expected"]["digest"]], f"{mode}: served != the learner's merge"
    assert r0["blocking"]["gathers"] == r1["blocking"]["gathers"] == r0["blocking"]["expected"]["n_parts"]
    # overlap: no gather on the training path; rank 0 received each part's rows from rank 1 and merged them
    assert r0["overlap"]["gathers"] == r1["overlap"]["gathers"] == 0
    assert r0["overlap"]["moved"] == r1["overlap"]["moved"] >= r0["overlap"]["expected"]["n_parts"] // 2
    assert r0["blocking"]["expected"]["digest"] != r0["overlap"]["expected"]["digest"], "a step between pushes"
    assert r0["overlap"]["started"] == 1 and r0["overlap"]["ver"] == r0["overlap"]["ver_before"] + 1
    assert r0["frozen_unchanged"] and r1["frozen_unchanged"], "a push merged into the frozen base weights"
    assert r0["aligned"] == r1["aligned"] == 2
