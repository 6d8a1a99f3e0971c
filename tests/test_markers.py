"""The test groups: every file that starts a process or opens a socket is marked ``integration``
(tests/conftest.py, ``INTEGRATION_FILES``), and every test carries exactly one group.

The rule reads each test file's source for what starts processes or sockets in this suite: ``subprocess``
calls, the server, learner and rank helpers of tests/, the launcher's supervisor, multiprocessing,
``torch.distributed.run``, ZMQ, raw sockets, uvicorn, a free port block. A file the rule flags and the table
lacks fails here with the line that flagged it.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import INTEGRATION_FILES, group_of

TESTS = Path(__file__).resolve().parent
STARTS = re.compile(
    r"subprocess\.(?:run|Popen|check_output|check_call|call)\(|\bPopen\(|\bProc\(\[|\bProcessSpec\(|\blaunch_learner\(|"
    r"\bstart_server\(|\brollout_server_process\(|\brun_ranks\(|\bget_context\(|multiprocessing\.Process|"
    r'sys\.executable, "-m", "torch\.distributed\.run"|\bFakeLearnerRank\(|\bzmq\.|socket\.socket\(|'
    r"create_connection\(|uvicorn\.|\brun_bench_json\(|\bfree_port_block\(|"
    r"from tests\.test_learner_resume import train\b")


def test_every_file_that_starts_processes_or_sockets_is_marked_integration():
    unlisted = []
    for path in sorted(TESTS.rglob("test_*.py")):
        text = path.read_text(encoding="utf-8")
        hit = STARTS.search(text)
        if hit and path.name not in INTEGRATION_FILES:
            line = text.count("\n", 0, hit.start()) + 1
            unlisted.append(f"{path.relative_to(TESTS)}:{line}: {hit.group(0)!r}")
    assert not unlisted, ("these test files start processes or sockets: add them to INTEGRATION_FILES in "
                          "tests/conftest.py:\n" + "\n".join(unlisted))


def test_the_integration_table_names_only_test_files_that_exist():
    names = {p.name for p in TESTS.rglob("test_*.py")}
    assert not sorted(INTEGRATION_FILES - names), "remove from INTEGRATION_FILES (tests/conftest.py)"


def test_every_test_carries_exactly_one_group(request):
    groups = [m.name for m in request.node.iter_markers() if m.name in ("unit", "integration")]
    assert groups == ["unit"] == [group_of(Path(__file__))]
