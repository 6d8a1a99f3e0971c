"""Per-group counts of one test run, from its JUnit XML: unit and integration (tests/conftest.py) apart.

    python3 .ci/test_groups.py runs/ci/junit.xml

Every test case carries a ``group`` property (``pytest_itemcollected`` in tests/conftest.py); this prints, per
group, the tests that passed, failed (errors included), were skipped, and the seconds they took (the sum of
their durations: with two workers, more than the wall time), then the failures by group. The exit code is
that of the counting, not of the tests (``make test`` gives that).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict


def count(path: str) -> tuple[dict[str, Counter], dict[str, float], dict[str, list[str]]]:
    counts: dict[str, Counter] = defaultdict(Counter)
    seconds: dict[str, float] = defaultdict(float)
    failed: dict[str, list[str]] = defaultdict(list)
    for case in ET.parse(path).getroot().iter("testcase"):
        group = next((p.get("value") for p in case.iter("property") if p.get("name") == "group"), "ungrouped")
        outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                   else "skipped" if case.find("skipped") is not None else "passed")
        counts[group][outcome] += 1
        seconds[group] += float(case.get("time") or 0)
        if outcome == "failed":
            failed[group].append(f"{case.get('classname')}::{case.get('name')}")
    return counts, seconds, failed


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    counts, seconds, failed = count(argv[0])
    print(f"{'group':<12} {'passed':>7} {'failed':>7} {'skipped':>8} {'test s':>8}")
    for group in sorted(counts):
        c = counts[group]
        print(f"{group:<12} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8} {seconds[group]:>8.0f}")
    for group, names in sorted(failed.items()):
        print(f"failed ({group}): " + ", ".join(names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
