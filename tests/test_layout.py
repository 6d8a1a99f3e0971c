"""The layout is the architecture: which folder may import which, file sizes, no shadowed stdlib names.

Process folders (one per process kind) meet only through ``common/`` (contracts, no torch) and
``common/tensors/`` (shared code that needs torch, never fastapi or vLLM). The one import allowed
between process folders is ``learner/modes.py`` → ``actor/``: the one-process modes run the actor's
pipeline as a library. ``tandem/`` is the console command above every process folder; it reaches
them by module name only. docs/architecture.md draws the same rules.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROCESS_FOLDERS = ("actor", "learner", "rollout_server", "stage_b", "launcher", "evaluator")
ALLOWED_CROSSING = {("learner/modes.py", "actor")}
MAX_LINES = 450
HEAVY_FOR_COMMON = ("torch", "fastapi", "vllm", "uvicorn", "transformers")


def source_files(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts)


def imports(path: Path, *, module_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path`` (deferred imports inside functions included unless
    ``module_level_only``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if module_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def test_process_folders_import_each_other_only_where_allowed():
    crossings = []
    for path in source_files(*PROCESS_FOLDERS, "common"):
        own = rel(path).split("/")[0]
        for line, module in imports(path):
            top = module.split(".")[0]
            if top in PROCESS_FOLDERS and top != own and (rel(path), top) not in ALLOWED_CROSSING:
                crossings.append(f"{rel(path)}:{line} imports {module}")
    assert not crossings, ("imports between process folders (move the shared code to common/ or common/tensors/):\n"
                           + "\n".join(crossings))


def test_the_allowed_crossing_is_still_used():
    """The allow-list stays exact: a crossing that disappeared must leave the list too."""
    for path, target in ALLOWED_CROSSING:
        assert any(m.split(".")[0] == target for _, m in imports(REPO / path)), (path, target)


def test_common_has_no_heavy_module_level_imports_and_tensors_no_server_ones():
    bad = []
    for path in source_files("common"):
        in_tensors = "tensors" in path.relative_to(REPO / "common").parts
        forbidden = ("fastapi", "vllm", "uvicorn") if in_tensors else HEAVY_FOR_COMMON
        for line, module in imports(path, module_level_only=not in_tensors):
            if module.split(".")[0] in forbidden:
                bad.append(f"{rel(path)}:{line} imports {module}")
    assert not bad, "common/ must stay importable without the heavy stacks:\n" + "\n".join(bad)


def test_no_module_next_to_a_script_shadows_the_standard_library():
    """``torchrun learner/main.py`` puts learner/ first on sys.path: a learner/queue.py would replace ``queue``."""
    shadows = [rel(p) for p in source_files("learner") if p.parent == REPO / "learner"
               and p.stem in sys.stdlib_module_names]
    assert not shadows, shadows


def test_no_source_file_outside_the_tests_is_over_the_size_limit():
    big = [f"{rel(p)}: {n} lines" for p in source_files(*PROCESS_FOLDERS, "common", "tandem", "tools", "bench")
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES]
    assert not big, f"split these along a seam (limit {MAX_LINES} lines):\n" + "\n".join(big)


def test_every_package_module_imports_cleanly_without_optional_stacks():
    """Each module of the layout imports on this CPU box (vLLM absent: the vLLM engine defers it)."""
    import importlib

    failed = []
    for path in source_files(*PROCESS_FOLDERS, "common"):
        if path.name == "__main__.py":
            continue
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - collected and reported together
            failed.append(f"{module}: {type(exc).__name__}: {exc}")
    assert not failed, "\n".join(failed)


#: What a reference to a document outside the repository looks like: the development environment's shared
#: folder, or a design section not cited through the repository's own copy (docs/design.md).
OUTSIDE_REFERENCES = (
    re.compile(r"\.\./shared/"),
    re.compile(r"(?<!docs/design\.md )\bdesign (section|brief)\b"),
    re.compile(r"\borigin[- ]semantics\b", re.IGNORECASE),
)


def test_code_and_docs_cite_only_documents_the_repository_holds():
    files = [p for p in REPO.rglob("*") if p.suffix in (".py", ".md", ".yaml", ".sh", ".toml") and p.is_file()
             and not ({".git", "artifacts", "runs", "__pycache__", ".whl"} & set(p.relative_to(REPO).parts))]
    found = [f"{rel(p)}:{n}: {line.strip()[:100]}" for p in files
             for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if any(rx.search(line) for rx in OUTSIDE_REFERENCES) and p != Path(__file__)]
    assert not found, "cite docs/ (docs/design.md holds the design contracts) instead of:\n" + "\n".join(found)
    for p in files:  # every "docs/<name>.md" named anywhere exists
        for name in re.findall(r"\bdocs/([a-z_]+\.md)\b", p.read_text(encoding="utf-8", errors="replace")):
            assert (REPO / "docs" / name).exists(), f"{rel(p)} cites docs/{name}, which does not exist"
