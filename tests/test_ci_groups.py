"""CI's per-group report (.ci/run -> .ci/test_groups.py): one pytest run under two xdist workers, as ``make test``
runs, writes a JUnit XML whose test cases carry their group, and the counts come out per group."""

from __future__ import annotations

import subprocess
import sys

from tests.server_proc import REPO

ONE_OF_EACH = ["tests/test_markers.py::test_the_integration_table_names_only_test_files_that_exist",
               "tests/test_plot_results.py::test_a_file_without_plottable_data_is_an_error"]


def test_one_run_under_two_workers_is_counted_per_group(tmp_path):
    junit = tmp_path / "junit.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", *ONE_OF_EACH,
                          f"--junitxml={junit}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = subprocess.run([sys.executable, ".ci/test_groups.py", str(junit)], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    rows = {line.split()[0]: line.split()[1:4] for line in report.stdout.splitlines()[1:]}
    assert rows == {"integration": ["1", "0", "0"], "unit": ["1", "0", "0"]}, report.stdout
