"""The load generator and statistics of bench/bench_vs_vllm_serve.py (no server started, no GPU needed).

    prompts(n) ─┬─► drive_completions: the official ``openai`` client (AsyncOpenAI ``completions.create``),
                │   one prompt per request, ``concurrency`` requests in flight ────────────┬─► RoundResult
                └─► drive_infer: httpx on tandem's ``/infer``, ``batch`` text-only chat    │   per round
                    items per request, ``concurrency // batch`` requests in flight ────────┘
    RoundResults ─► summarize (medians over rounds) ─► ratios (tandem / vllm serve) ─► table

Every request asks for exactly ``max_tokens`` tokens: greedy (temperature 0) with ``ignore_eos`` (vLLM's
extra parameter; tandem's ``/v1/completions`` and ``/infer`` take it too), so both servers generate the
same number of tokens; tokens are counted from the server's answer (``usage.completion_tokens``, or
``len(token_ids)`` on /infer) and a round whose count is not ``prompts x max_tokens`` is flagged.

The ``openai`` package is imported when a completions round starts (it ships with vLLM and with
tandem's dev extras), so this module imports without it. What this module does not know: how the
servers are started or which GPU they run on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

#: Server log lines kept in the result: the engine configuration each server ended up with.
ENGINE_LOG_MARKERS = ("non-default args", "with config:", "GPU KV cache size", "Maximum concurrency",
                      "max_num_seqs", "max_num_batched_tokens", "Graph capturing finished")


@dataclasses.dataclass
class RoundResult:
    """One timed round against one server route."""

    route: str  # "completions" or "infer"
    wall_s: float
    requests: int
    items: int
    tokens: int  # completion tokens the server reported
    expected_tokens: int  # items x max_tokens
    latencies_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s

    def summary(self) -> dict[str, float | int | bool]:
        lat = sorted(self.latencies_s)
        return {"tokens_per_s": self.tokens_per_s, "requests_per_s": self.requests_per_s,
                "items_per_s": self.items / self.wall_s, "latency_p50_s": quantile(lat, 0.5),
                "latency_p90_s": quantile(lat, 0.9), "wall_s": self.wall_s, "tokens": self.tokens,
                "full_length": self.tokens == self.expected_tokens}


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending list (numpy's default)."""
    if not sorted_values:
        return float("nan")
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def prompts(n: int) -> list[str]:
    """``n`` fixed, distinct, short English prompts (the same list for every server and round)."""
    subjects = ("a red square", "two blue circles", "a green triangle", "three yellow stars", "a small boat",
                "an old bridge", "a quiet street", "a busy kitchen")
    return [f"Request {i}: describe {subjects[i % len(subjects)]} in a few sentences." for i in range(n)]


async def _run_workers(jobs: Sequence[Any], workers: int, one: Callable[[Any], Awaitable[tuple[int, int]]]
                       ) -> tuple[float, list[float], int, int]:
    """``workers`` coroutines take jobs in order until none is left; returns wall, latencies, tokens, items."""
    queue = list(reversed(jobs))
    latencies: list[float] = []
    totals = [0, 0]

    async def worker() -> None:
        while queue:
            job = queue.pop()
            t0 = time.perf_counter()
            tokens, items = await one(job)
            latencies.append(time.perf_counter() - t0)
            totals[0] += tokens
            totals[1] += items

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, min(workers, len(jobs))))))
    return time.perf_counter() - t0, latencies, totals[0], totals[1]


async def drive_completions(base_url: str, model: str, texts: Sequence[str], *, concurrency: int, max_tokens: int,
                            timeout_s: float = 600.0) -> RoundResult:
    """One ``/v1/completions`` request per prompt with the official ``openai`` client, ``concurrency`` in flight."""
    try:
        import openai
    except ImportError as exc:  # pragma: no cover - vLLM and tandem's dev extras both bring it
        raise SystemExit("the openai package is missing: pip install openai (or pip install -e '.[dev]')") from exc

    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", timeout=timeout_s,
                                  max_retries=0) as client:
        async def one(prompt: str) -> tuple[int, int]:
            out = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                  extra_body={"ignore_eos": True})
            if len(out.choices) != 1 or out.usage is None:
                raise RuntimeError(f"{base_url}: expected one choice and usage, got {out!r}"[:500])
            return out.usage.completion_tokens, 1

        wall, lat, tokens, items = await _run_workers(list(texts), concurrency, one)
    return RoundResult("completions", wall, len(texts), items, tokens, len(texts) * max_tokens, lat)


async def drive_infer(base_url: str, texts: Sequence[str], *, batch: int, concurrency: int, max_tokens: int,
                      timeout_s: float = 600.0) -> RoundResult:
    """tandem's ``/infer`` (the actors' route): the prompts as text-only chat items, ``batch`` per request,
    ``max(1, concurrency // batch)`` requests in flight (so about ``concurrency`` sequences run at once)."""
    import httpx

    from common.wire.http import InferResponse

    batches = [list(texts[k:k + batch]) for k in range(0, len(texts), batch)]
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as client:
        async def one(chunk: list[str]) -> tuple[int, int]:
            body = {"items": [{"messages": [{"role": "user", "content": t}]} for t in chunk], "sampling": sampling,
                    "client": "bench"}
            r = await client.post("/infer", content=json.dumps(body), headers={"content-type": "application/json"})
            if r.status_code != 200:
                raise RuntimeError(f"{base_url}/infer -> {r.status_code}: {r.text[:300]}")
            outs = InferResponse.model_validate_json(r.content).outputs
            return sum(len(o.token_ids) for o in outs), len(outs)

        wall, lat, tokens, items = await _run_workers(batches, max(1, concurrency // batch), one)
    return RoundResult("infer", wall, len(batches), items, tokens, len(texts) * max_tokens, lat)


def summarize(rounds: Sequence[RoundResult]) -> dict[str, Any]:
    """Medians over rounds of each figure; ``full_length`` only if every round generated every token."""
    per = [r.summary() for r in rounds]
    out: dict[str, Any] = {k: statistics.median(p[k] for p in per) for k in
                           ("tokens_per_s", "requests_per_s", "items_per_s", "latency_p50_s", "latency_p90_s",
                            "wall_s")}
    out.update(rounds=len(per), tokens_per_round=[p["tokens"] for p in per],
               tokens_per_s_rounds=[round(p["tokens_per_s"], 1) for p in per],
               full_length=all(p["full_length"] for p in per))
    return out


def ratios(summaries: dict[str, dict[str, Any]], baseline: str = "vllm_serve") -> dict[str, float]:
    """tokens/s of every other entry over the baseline's (absent when the baseline did not run)."""
    base = summaries.get(baseline)
    if not base:
        return {}
    return {name: s["tokens_per_s"] / base["tokens_per_s"] for name, s in summaries.items() if name != baseline}


def table(summaries: dict[str, dict[str, Any]], rat: dict[str, float]) -> str:
    """One row per server route: the medians and the ratio to ``vllm serve``."""
    rows = [f"{'server / route':<24} {'tok/s':>9} {'req/s':>8} {'items/s':>8} {'p50 s':>7} {'p90 s':>7} "
            f"{'rounds':>6} {'vs serve':>8} {'full len':>8}"]
    for name, s in summaries.items():
        ratio = f"{rat[name]:.3f}" if name in rat else "-"
        rows.append(f"{name:<24} {s['tokens_per_s']:>9.1f} {s['requests_per_s']:>8.2f} {s['items_per_s']:>8.2f} "
                    f"{s['latency_p50_s']:>7.3f} {s['latency_p90_s']:>7.3f} {s['rounds']:>6} {ratio:>8} "
                    f"{'yes' if s['full_length'] else 'NO':>8}")
    return "\n".join(rows)


def engine_log_lines(text: str) -> list[str]:
    """The engine-configuration lines of a server log (each from its marker on), for a side-by-side diff."""
    out = []
    for line in text.splitlines():
        starts = [i for i in (line.find(m) for m in ENGINE_LOG_MARKERS) if i >= 0]
        if starts:
            out.append(line[min(starts):][:2000])
    return out
