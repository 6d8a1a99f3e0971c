"""Pack fill of the actor's Packer against a first-fit baseline and a version-agnostic ideal (issue 19, CPU).

    python bench/bench_packing.py [--segments 20000] [--json out.json]
    python bench/bench_packing.py --quick      # make test: 3000 segments per run, a few seconds

Feeds the real ``common.packing.packer.Packer`` (no sockets, a fake clock) synthetic segment streams and
counts what leaves. A stream: lengths drawn from one mix (lengths above ``packing_length`` are
redrawn: the actor would drop them as too long), arriving in batches of ``--batch`` segments (decode
batch x rollouts in flight) at ``rate`` segments/s of fake time, the ver advancing every ``ver_every``
segments (``advance_ver(..., "flush")``, as ``actor/loop.py`` does on the first segment of a newer ver).
Per batch the loop does what the actor's tick does: ``pop_ready`` (what waited ``max_wait_s`` leaves),
add the batch, ``pop_ready``; ``flush_all`` at the end.

Mixes: ``detection`` N(300, 80) tokens (clipped at 32); ``bimodal`` 65 % N(220, 40) + 35 % N(1100, 200)
(text-only and image-heavy samples); ``longtail`` lognormal with median 350, sigma 0.7 (p99 ~1800).

Policies (all version-pure but the last):
  - ``tandem``: the Packer as shipped (oldest segment + exact best-subset fill of its (ver, channel) group);
  - ``greedy``: the Packer with the selection before issue 19 (oldest + the better of FIFO-greedy and
    first-fit-decreasing);
  - ``first-fit``: arrival order, a pack closes when the next segment does not fit or the ver changes
    (no clock: it waits as long as it takes);
  - ``no-ver``: the tandem Packer fed every segment as ver 0, so nothing is flushed: the ideal
    version-agnostic packing under the same arrival and release rules. ``fill(no-ver) - fill(tandem)``
    is the fill lost to version purity.

Columns: packs, mean and p10 fill, then the capacity left empty by why a pack left (as fractions of
``packs x packing_length``; with the mean fill they add up to 1): ``ready`` (left at min fill, or
first-fit's no-fit close), ``wait`` (``max_wait_s``), ``flush`` (ver advance or the final flush), and
``buf``: mean segments buffered after a tick. Tables: the grid (every mix x packing_length at the
chosen min fill, rate and ver interval), then sweeps of the buffer (min fill x arrival rate) and of
the ver interval on the detection mix at 4096. Final line: one JSON object (``rows``, ``grid``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from common.packing.packer import Packer  # noqa: E402
from common.packing.segment import Pack, Segment  # noqa: E402

MIXES = ("detection", "bimodal", "longtail")
POLICIES = ("tandem", "greedy", "first-fit", "no-ver")
_ZEROS = np.zeros(1 << 16, np.int64)  # segments are views of it: the packer reads lengths, vers and channels only


def draw_lengths(mix: str, n: int, packing_length: int, seed: int) -> list[int]:
    """``n`` segment lengths of ``mix``, each in [32, packing_length] (over-long draws are redrawn)."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n:
        m = 2 * (n - len(out))
        if mix == "detection":
            x = rng.normal(300, 80, m)
        elif mix == "bimodal":
            x = np.where(rng.random(m) < 0.65, rng.normal(220, 40, m), rng.normal(1100, 200, m))
        elif mix == "longtail":
            x = rng.lognormal(math.log(350), 0.7, m)
        else:
            raise ValueError(f"unknown mix {mix!r}, expected one of {MIXES}")
        x = np.maximum(np.rint(x), 32).astype(int)
        out += x[x <= packing_length].tolist()
    return out[:n]


def _segment(length: int, ver: int) -> Segment:
    z = _ZEROS[:length]
    return Segment(sample_id="", channel="B", ver=ver, input_ids=z, labels=z, weights=z, position_ids=z[None],
                   coord_pos=_ZEROS[:0], coord_bins=_ZEROS[:0], pixel_values=_ZEROS[:0], image_grid_thw=_ZEROS[:0])


class GreedyPacker(Packer):
    """The Packer with its selection before issue 19 (kept here only as the benchmark's "before")."""

    def _select(self, group):  # noqa: ANN001, ANN202 (overrides a private hook on purpose)
        oldest, rest = group[0], group[1:]
        room = self.packing_length - oldest.segment.length
        fifo = _greedy(rest, room)
        ffd = _greedy(sorted(rest, key=lambda w: -w.segment.length), room)
        best = ffd if sum(w.segment.length for w in ffd) > sum(w.segment.length for w in fifo) else fifo
        order = {id(w): i for i, w in enumerate(group)}
        return [oldest, *sorted(best, key=lambda w: order[id(w)])]


def _greedy(candidates, room: int):  # noqa: ANN001, ANN202
    taken = []
    for w in candidates:
        if w.segment.length <= room:
            taken.append(w)
            room -= w.segment.length
    return taken


def run_packer(policy: str, lengths: list[int], packing_length: int, min_fill: float, rate: float, batch: int,
               ver_every: int, max_wait_s: float) -> dict:
    """Stream ``lengths`` through a Packer; the release reason of each pack comes from its counters."""
    now = [0.0]
    packer = (GreedyPacker if policy == "greedy" else Packer)(packing_length, min_fill, max_wait_s, clock=lambda: now[0])
    packs: list[Pack] = []
    buffered = []
    for start in range(0, len(lengths), batch):
        now[0] = start / rate
        packs += packer.pop_ready()
        for i in range(start, min(start + batch, len(lengths))):
            ver = 0 if policy == "no-ver" else i // ver_every
            if packer.ver is None or ver > packer.ver:
                packs += packer.advance_ver(ver, "flush")
            packer.add(_segment(lengths[i], ver))
        packs += packer.pop_ready()
        buffered.append(packer.buffered)
    packs += packer.flush_all()
    c = packer.counters
    lost = {r: c[f"fill_lost_{r}_tokens"] for r in ("ready", "wait", "flush")}
    return _row(packs, packing_length, lost, c["segments_built"] - c["segments_packed"], buffered)


def run_first_fit(lengths: list[int], packing_length: int, batch: int, ver_every: int) -> dict:
    """Arrival order; close the open pack when the next segment does not fit ("ready") or its ver differs ("flush")."""
    packs: list[Pack] = []
    lost = {"ready": 0, "wait": 0, "flush": 0}
    open_: list[Segment] = []
    buffered = []

    def close(reason: str) -> None:
        pack = Pack(ver=open_[0].ver, channel="B", segments=list(open_))
        packs.append(pack)
        lost[reason] += packing_length - pack.n_tokens
        open_.clear()

    for i, n in enumerate(lengths):
        segment = _segment(n, i // ver_every)
        if open_ and segment.ver != open_[0].ver:
            close("flush")
        elif open_ and sum(s.length for s in open_) + n > packing_length:
            close("ready")
        open_.append(segment)
        if (i + 1) % batch == 0:
            buffered.append(len(open_))
    if open_:
        close("flush")
    return _row(packs, packing_length, lost, 0, buffered)


def _row(packs: list[Pack], packing_length: int, lost: dict, lost_segments: int, buffered: list[int]) -> dict:
    fills = np.array([p.n_tokens / packing_length for p in packs])
    capacity = len(packs) * packing_length
    return {
        "packs": len(packs),
        "segments": sum(len(p.segments) for p in packs),
        "tokens": int(sum(p.n_tokens for p in packs)),
        "unpacked_segments": int(lost_segments),
        "mean_fill": float(fills.mean()),
        "p10_fill": float(np.percentile(fills, 10)),
        "lost_ready": lost["ready"] / capacity,
        "lost_wait": lost["wait"] / capacity,
        "lost_flush": lost["flush"] / capacity,
        "mean_buffered": float(np.mean(buffered)) if buffered else 0.0,
        "version_pure": all(len({s.ver for s in p.segments}) == 1 for p in packs),
        "max_tokens": max(p.n_tokens for p in packs),
    }


def scenario(mix: str, packing_length: int, min_fill: float, rate: float, ver_every: int, args: argparse.Namespace,
             policies: tuple[str, ...] = POLICIES) -> list[dict]:
    lengths = draw_lengths(mix, args.segments, packing_length, seed=args.seed)
    rows = []
    for policy in policies:
        if policy == "first-fit":
            r = run_first_fit(lengths, packing_length, args.batch, ver_every)
        else:
            r = run_packer(policy, lengths, packing_length, min_fill, rate, args.batch, ver_every, args.max_wait_s)
        r.update(mix=mix, packing_length=packing_length, policy=policy, min_fill=min_fill, rate=rate,
                 ver_every=ver_every, tokens_in=int(sum(lengths)), segments_in=len(lengths),
                 bound_packs=math.ceil(sum(lengths) / packing_length))
        rows.append(r)
    return rows


HEADER = (f"{'mix':<10} {'L':>5} {'fill≥':>5} {'seg/s':>6} {'ver/K':>6} {'policy':<10} {'packs':>6} {'fill':>6} "
          f"{'p10':>6} {'ready':>6} {'wait':>6} {'flush':>6} {'buf':>6}")


def line(r: dict) -> str:
    return (f"{r['mix']:<10} {r['packing_length']:>5} {r['min_fill']:>5.2f} {r['rate']:>6g} {r['ver_every']:>6} "
            f"{r['policy']:<10} {r['packs']:>6} {r['mean_fill']:>6.3f} {r['p10_fill']:>6.3f} {r['lost_ready']:>6.3f} "
            f"{r['lost_wait']:>6.3f} {r['lost_flush']:>6.3f} {r['mean_buffered']:>6.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--segments", type=int, default=20000, help="segments per stream")
    p.add_argument("--min-fill", type=float, default=0.95, help="packing_min_fill_ratio of the grid (issue 19: 0.95)")
    p.add_argument("--rate", type=float, default=20.0, help="segments per second of fake time in the grid")
    p.add_argument("--ver-every", type=int, default=128, help="segments per ver in the grid")
    p.add_argument("--batch", type=int, default=4, help="segments arriving together (decode batch x in flight)")
    p.add_argument("--max-wait-s", type=float, default=2.0, help="pack_max_wait_s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="3000 segments per stream, short sweeps (make test)")
    p.add_argument("--json", type=Path, default=None, help="also write the final JSON object here")
    args = p.parse_args(argv)
    if args.quick:
        args.segments = 3000
    t0 = time.perf_counter()
    grid = [r for mix in MIXES for length in (1024, 2048, 4096)
            for r in scenario(mix, length, args.min_fill, args.rate, args.ver_every, args)]
    fills = (0.65, 0.95) if args.quick else (0.65, 0.8, 0.9, 0.95)
    rates = (5.0, 20.0) if args.quick else (2.0, 5.0, 10.0, 20.0, 200.0)
    buffer = [r for f in fills for rate in rates
              for r in scenario("detection", 4096, f, rate, args.ver_every, args, ("tandem", "greedy"))]
    vers = (32, 512) if args.quick else (16, 32, 64, 128, 512, 2048)
    version = [r for k in vers for r in scenario("detection", 4096, args.min_fill, args.rate, k, args,
                                                  ("tandem", "first-fit", "no-ver"))]
    for title, rows in (("grid", grid), ("buffer: min fill x arrival rate", buffer), ("ver interval", version)):
        print(f"\n{title} ({args.segments} segments per run, max_wait_s {args.max_wait_s}, batch {args.batch})")
        print(HEADER)
        for r in rows:
            print(line(r))
    purity = {f"{r['mix']}/{r['packing_length']}": r["mean_fill"] for r in grid if r["policy"] == "no-ver"}
    tandem = {f"{r['mix']}/{r['packing_length']}": r["mean_fill"] for r in grid if r["policy"] == "tandem"}
    lost_to_purity = {k: purity[k] - tandem[k] for k in tandem}
    print("\nfill lost to version purity (no-ver - tandem): "
          + ", ".join(f"{k} {v:+.3f}" for k, v in lost_to_purity.items()))
    result = {"segments": args.segments, "min_fill": args.min_fill, "rate": args.rate, "ver_every": args.ver_every,
              "max_wait_s": args.max_wait_s, "batch": args.batch, "grid": grid, "buffer": buffer, "version": version,
              "lost_to_purity": lost_to_purity, "elapsed_s": round(time.perf_counter() - t0, 2)}
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
