"""The vLLM engine's own logic (rollout_server/engines/vllm/engine.py) against a stand-in for AsyncLLM.

vLLM does not run on CPU CI, so ``AsyncLLM`` is replaced by an object with the calls the engine makes;
its ``collective_rpc`` goes into real worker-extension hosts (tests/test_vllm_fastload_extension.py)
that load real chunks. What is checked here is the engine's part: which worker calls a sync makes (a
prepare once, then one call per sync, again after a native update), turning the fast path off, the
fence's pause without vLLM's settle sleep (and the public call where the internals are missing), and
the commit's cache resets. The real thing runs in tests/test_gpu_vllm.py.
"""

from __future__ import annotations

import asyncio

from tests.test_load_plan import hf_weights, native, same, stream
from tests.test_vllm_fastload_extension import Group, Worker, layout_of


class FakeAsyncLLM:
    """``collective_rpc`` into real extension workers (what AsyncLLM does through its engine core)."""

    def __init__(self, workers, chunks_per_sync, prefix_ok=True):
        self.workers, self.calls, self.chunks_per_sync, self.prefix_ok = workers, [], chunks_per_sync, prefix_ok

    async def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")
        return self.prefix_ok  # False: KV blocks still held

    async def reset_mm_cache(self):
        self.calls.append("reset_mm_cache")

    async def reset_encoder_cache(self):
        self.calls.append("reset_encoder_cache")

    async def collective_rpc(self, method, timeout=None, kwargs=None):
        self.calls.append(method)
        if method == "tandem_receive":
            for w in self.workers:
                w.weight_transfer_engine.model_update_group = Group(self.chunks_per_sync())
        return [getattr(w, method)(**(kwargs or {})) for w in self.workers]


def _engine(workers, chunks_per_sync):
    from rollout_server.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM here: the load-path logic on fake RPCs
    engine.llm = FakeAsyncLLM(workers, chunks_per_sync)
    engine._bucket_bytes, engine._session_timeout_s = 600, 30.0
    engine._fast_key, engine._fast_refused, engine._fast_updated = None, None, False
    engine.last_update_info = None
    return engine


def _header(weights):
    from common.weight_sync.messages import SyncBucketHeader

    lay = layout_of(weights)
    return SyncBucketHeader(session="s", index=0, names=lay["names"], dtypes=lay["dtypes"], shapes=lay["shapes"],
                            offsets=lay["offsets"])


def test_engine_prepares_once_then_receives_in_one_call_until_a_native_update():
    workers = [Worker(), Worker()]
    current = {"w": hf_weights(1)}
    engine = _engine(workers, lambda: stream(current["w"], 600)[1])
    for seed in (1, 2):
        current["w"] = hf_weights(seed)
        engine.llm.calls.clear()
        assert asyncio.run(engine._receive_fast(_header(current["w"]), 1))
        want = ["tandem_prepare", "tandem_receive"] if seed == 1 else ["tandem_receive"]
        assert engine.llm.calls == want, (seed, engine.llm.calls)
        assert engine.last_update_info["one_call"] is (seed == 2)
        for w in workers:
            same(w.weight_transfer_engine.model, native(current["w"]))
    engine._fast_key = None  # what _receive_native does: plan again after a native update
    engine.llm.calls.clear()
    assert asyncio.run(engine._receive_fast(_header(current["w"]), 1))
    assert engine.llm.calls == ["tandem_prepare", "tandem_receive"]


def test_engine_turns_the_fast_path_off_after_a_worker_loaded_through_its_loaders():
    workers = [Worker(), Worker()]
    current = {"w": hf_weights(1)}
    engine = _engine(workers, lambda: stream(current["w"], 600)[1])
    assert asyncio.run(engine._receive_fast(_header(current["w"]), 1))
    workers[1].weight_transfer_engine.model.mode = "item"
    workers[1].weight_transfer_engine.model.qkv.data = workers[1].weight_transfer_engine.model.qkv.data.clone()
    current["w"] = hf_weights(2)
    assert asyncio.run(engine._receive_fast(_header(current["w"]), 1))  # one call; worker 1 goes direct
    assert engine._fast_refused and "could not plan" in engine._fast_refused
    assert engine._fast_key is None
    same(workers[1].weight_transfer_engine.model, native(current["w"], "item"))


class FakeCore:
    def __init__(self, log):
        self.log = log

    async def pause_scheduler_async(self, mode, clear_cache):
        self.log.append(("pause_scheduler", mode, clear_cache))


class FakeRenderer:
    def __init__(self, log):
        self.log = log

    async def clear_mm_cache_async(self):
        self.log.append(("clear_mm_cache",))


class PausingLLM:
    def __init__(self, internals: bool):
        self.log: list[tuple] = []
        if internals:
            self.engine_core, self.renderer = FakeCore(self.log), FakeRenderer(self.log)

    async def pause_generation(self, mode, clear_cache):
        self.log.append(("pause_generation", mode, clear_cache))
        await asyncio.sleep(0.02)  # vLLM's settle sleep


def test_pause_skips_the_settle_sleep_where_the_internals_exist_and_falls_back_elsewhere():
    engine = _engine([], lambda: [])
    engine.llm = PausingLLM(internals=True)
    asyncio.run(engine.pause())
    assert engine.llm.log == [("clear_mm_cache",), ("pause_scheduler", "abort", True)]
    engine.llm = PausingLLM(internals=False)  # a vLLM release without them: the public call
    asyncio.run(engine.pause())
    assert engine.llm.log == [("pause_generation", "abort", True)]


def test_commit_after_a_fast_update_resets_every_cache_and_reports_a_failed_prefix_reset():
    current = {"w": hf_weights(1)}
    for prefix_ok in (True, False):
        engine = _engine([Worker()], lambda: stream(current["w"], 600)[1])
        engine.llm.prefix_ok = prefix_ok
        engine._manifest = {n: None for n in layout_of(current["w"])["names"]}
        engine._nccl_updating, engine._staged, engine._fingerprint = False, {}, "unknown"
        assert asyncio.run(engine._receive_fast(_header(current["w"]), 1))
        engine._received = set(engine._manifest)
        engine.llm.calls.clear()
        assert asyncio.run(engine.commit("f" * 16)) is prefix_ok
        assert sorted(engine.llm.calls) == ["reset_encoder_cache", "reset_mm_cache", "reset_prefix_cache"]
        assert engine.fingerprint() == "f" * 16 and not engine._fast_updated and not engine._received


class StreamingLLM:
    """``AsyncLLM.generate`` as an endless stream (never finishes on its own); records ``abort`` calls."""

    def __init__(self):
        self.started, self.aborted = [], []

    async def generate(self, prompt, sp, request_id):
        self.started.append(request_id)
        while True:
            await asyncio.sleep(0.01)
            yield None

    async def abort(self, request_id):
        self.aborted.append(request_id)


def test_cancelling_a_generate_aborts_every_request_id_of_the_batch_on_the_engine():
    from types import SimpleNamespace

    from common.wire.http import InferItem, SamplingParams

    engine = _engine([], lambda: [])
    engine.llm, engine.tokenizer, engine._vocab, engine.max_request_tokens = StreamingLLM(), None, 100, None
    engine._sampling = lambda s: SimpleNamespace(logprobs=None)  # vLLM's SamplingParams is not importable here
    items = [InferItem(prompt_token_ids=[1, 2]), InferItem(prompt_token_ids=[3])]

    async def client_goes_away():
        task = asyncio.ensure_future(engine.generate(items, SamplingParams(max_tokens=8)))
        while len(engine.llm.started) < 2:
            await asyncio.sleep(0.01)
        task.cancel()  # what the server does when the client disconnects (or an abort fence cuts the batch)
        await asyncio.gather(task, return_exceptions=True)
        return task

    task = asyncio.run(client_goes_away())
    assert task.cancelled()
    assert sorted(engine.llm.aborted) == sorted(engine.llm.started) and len(engine.llm.started) == 2


def test_a_batch_over_the_token_budget_is_a_413_before_vllm_sees_it():
    import pytest

    from common.wire.http import InferItem, SamplingParams
    from rollout_server.engines.base import EngineInputError

    class Tok:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": list(range(len(text.split())))}

    engine = _engine([], lambda: [])
    engine.llm, engine.tokenizer, engine._vocab, engine.max_request_tokens = StreamingLLM(), Tok(), 100, 20
    items = [InferItem(prompt_token_ids=[1, 2, 3]), InferItem(prompt_token_ids=[4, 5])]
    with pytest.raises(EngineInputError) as info:
        asyncio.run(engine.generate(items, SamplingParams(max_tokens=8)))  # 3 + 2 + 2 x 8 = 21 > 20
    assert info.value.status == 413 and "rollout_server.max_request_tokens = 20" in str(info.value)
    assert engine.llm.started == []


class FinalLLM:
    """``AsyncLLM.generate`` that answers each request with one final output; records the prompts it got."""

    def __init__(self):
        self.prompts = []

    async def generate(self, prompt, sp, request_id):
        from types import SimpleNamespace

        self.prompts.append(prompt)
        yield SimpleNamespace(prompt_token_ids=prompt.get("prompt_token_ids"), outputs=[
            SimpleNamespace(token_ids=[1, 2], text="ab", finish_reason="length", logprobs=None)])


class CountingTok:
    """A chat template and a whitespace tokenizer that counts its calls."""

    def __init__(self):
        self.calls = 0

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "<|im_start|> " + " ".join(m["content"] for m in messages) + " <|im_end|>"

    def __call__(self, text, add_special_tokens=True):
        self.calls += 1
        assert add_special_tokens is False, "the rendered template carries its own special tokens"
        return {"input_ids": [len(w) for w in text.split()]}


def test_a_text_only_chat_prompt_reaches_vllm_as_token_ids_tokenized_once_for_budget_and_engine():
    from types import SimpleNamespace

    from common.wire.http import InferItem, SamplingParams

    engine = _engine([], lambda: [])
    engine.llm, engine.tokenizer, engine._vocab, engine.max_request_tokens = FinalLLM(), CountingTok(), 100, 1000
    engine._sampling = lambda s: SimpleNamespace(logprobs=None)
    items = [InferItem(id="chat", messages=[{"role": "user", "content": "find the boats"}]),
             InferItem(id="ids", prompt_token_ids=[5, 6])]
    outs = asyncio.run(engine.generate(items, SamplingParams(max_tokens=8)))
    assert engine.llm.prompts == [{"prompt_token_ids": [12, 4, 3, 5, 10]}, {"prompt_token_ids": [5, 6]}]
    assert engine.tokenizer.calls == 1  # the budget counted the same ids vLLM got: no second tokenization
    assert [o.id for o in outs] == ["chat", "ids"] and outs[0].prompt_token_ids == [12, 4, 3, 5, 10]
    one = asyncio.run(engine.generate(items[1:], SamplingParams(max_tokens=8)))  # the one-item path
    assert [(o.id, o.token_ids) for o in one] == [("ids", [1, 2])]


def test_cancelling_a_one_item_generate_aborts_its_request_on_the_engine():
    from types import SimpleNamespace

    from common.wire.http import InferItem, SamplingParams

    engine = _engine([], lambda: [])
    engine.llm, engine.tokenizer, engine._vocab, engine.max_request_tokens = StreamingLLM(), None, 100, None
    engine._sampling = lambda s: SimpleNamespace(logprobs=None)

    async def client_goes_away():
        task = asyncio.ensure_future(engine.generate([InferItem(prompt_token_ids=[1, 2])], SamplingParams(max_tokens=8)))
        while not engine.llm.started:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return task

    assert asyncio.run(client_goes_away()).cancelled()
    assert engine.llm.aborted == engine.llm.started and len(engine.llm.started) == 1


def test_http_buckets_are_staged_in_shared_memory_and_loaded_by_the_workers_only_at_commit():
    """The vLLM engine's HTTP path: each bucket lands in a /dev/shm file (the workers are other processes), nothing
    is loaded before commit (a failed session keeps the old weights), commit has every worker load every bucket
    in place (``tandem_load_shared``), and the files are gone afterwards, as after a discard."""
    import os

    import pytest

    from common.weight_sync.messages import TensorSpec
    from common.weight_sync.shared import SHM_DIR

    if not os.path.isdir(SHM_DIR):
        pytest.skip("needs /dev/shm")
    workers = [Worker(), Worker()]
    engine = _engine(workers, lambda: [])
    first, second = hf_weights(1), hf_weights(2)
    engine._set_manifest([TensorSpec(name=n, dtype="bfloat16", shape=list(t.shape)) for n, t in first], [])
    engine._staged, engine._host_buckets, engine._received, engine._nccl_updating = {}, [], set(), False

    def shm_files():
        return {f for f in os.listdir(SHM_DIR) if f.startswith(f"tandem-sync-{os.getpid()}-")}

    def push(weights):
        before = shm_files()
        half = len(weights) // 2
        for part in (weights[:half], weights[half:]):
            asyncio.run(engine.stage_bucket(dict(part)))
        assert len(shm_files() - before) == 2 and engine.llm.calls == []  # staged, nothing loaded yet
        return before

    before = push(first)
    asyncio.run(engine.discard())  # an aborted session: files gone, the workers' weights untouched
    assert shm_files() == before and engine.llm.calls == []
    push(second)
    assert asyncio.run(engine.commit())
    assert engine.llm.calls.count("tandem_load_shared") == 2 and shm_files() == before
    for w in workers:
        same(w.weight_transfer_engine.model, native(second))
