"""``bench/bench_packing.py --quick`` (issue 19's packing benchmark runs in make test): the real Packer against a
first-fit baseline and a version-agnostic ideal, with books that balance."""

from __future__ import annotations

from tests.factories import run_bench_json


def test_the_quick_packing_bench_fills_at_least_as_well_as_first_fit_and_every_token_is_accounted_for(tmp_path):
    out = tmp_path / "packing.json"
    last = run_bench_json("bench_packing.py", ["--quick"], out, timeout_s=120)
    rows = last["grid"] + last["buffer"] + last["version"]
    for r in rows:
        where = f"{r['mix']}/{r['packing_length']} {r['policy']} fill>={r['min_fill']} rate {r['rate']} ver/{r['ver_every']}"
        assert r["tokens"] == r["tokens_in"] and r["segments"] == r["segments_in"], where  # nothing lost or doubled
        assert r["unpacked_segments"] == 0 and r["version_pure"] and r["max_tokens"] <= r["packing_length"], where
        assert abs(r["packs"] * r["mean_fill"] * r["packing_length"] - r["tokens"]) < 1e-6 * r["tokens"], where
        assert abs(r["mean_fill"] + r["lost_ready"] + r["lost_wait"] + r["lost_flush"] - 1) < 1e-9, where
        assert r["packs"] >= r["bound_packs"], where
    grid = {(r["mix"], r["packing_length"], r["policy"]): r for r in last["grid"]}
    assert {m for m, _, _ in grid} == {"detection", "bimodal", "longtail"}
    assert {n for _, n, _ in grid} == {1024, 2048, 4096}
    for (mix, length, policy), r in grid.items():
        if policy == "tandem":
            first_fit, ideal = grid[mix, length, "first-fit"], grid[mix, length, "no-ver"]
            assert r["mean_fill"] >= first_fit["mean_fill"], (mix, length, r["mean_fill"], first_fit["mean_fill"])
            assert r["packs"] <= first_fit["packs"], (mix, length)
            assert ideal["lost_flush"] < r["lost_flush"], (mix, length)  # only version-pure packers flush mid-stream
            assert abs(last["lost_to_purity"][f"{mix}/{length}"] - (ideal["mean_fill"] - r["mean_fill"])) < 1e-12
