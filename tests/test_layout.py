"""The layout is the architecture: which folder may import which, file sizes, no shadowed stdlib names.

Process folders (one per process kind) meet only through ``common/``: subpackages by concept (config, wire,
detection, evaluation, packing, data, runs), torch-free, and the few that need torch (``TORCH_PACKAGES``:
weight sync, generation, rank groups; never fastapi or vLLM). ``common/`` has no module of its own, and a
name is imported from the module that defines it, never through a re-export. The one import allowed
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
#: The subpackages of ``common/`` whose modules may import torch at module level (never fastapi or vLLM).
TORCH_PACKAGES = ("weight_sync", "generation", "distributed")
#: Where importers live: every folder of Python code, and the top-level conftest.
ALL_CODE = (*PROCESS_FOLDERS, "common", "tandem", "tools", "bench", "tests")


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
    assert not crossings, ("imports between process folders (move the shared code to a package of common/):\n"
                           + "\n".join(crossings))


def test_the_allowed_crossing_is_still_used():
    """The allow-list stays exact: a crossing that disappeared must leave the list too."""
    for path, target in ALLOWED_CROSSING:
        assert any(m.split(".")[0] == target for _, m in imports(REPO / path)), (path, target)


def test_common_has_no_heavy_module_level_imports_and_tensors_no_server_ones():
    bad = []
    for path in source_files("common"):
        in_tensors = path.relative_to(REPO / "common").parts[0] in TORCH_PACKAGES
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


def test_common_is_subpackages_only_each_init_a_docstring():
    """``common/`` holds packages by concept: no module in its root, and no package ``__init__`` that does more than
    say what the package is (a façade of re-exports hides where a name is defined)."""
    loose = [rel(p) for p in (REPO / "common").glob("*.py") if p.name != "__init__.py"]
    assert not loose, "move these into the common/ subpackage of their concept:\n" + "\n".join(loose)
    busy = []
    for init in sorted((REPO / "common").rglob("__init__.py")):
        body = ast.parse(init.read_text(encoding="utf-8")).body
        if len(body) > 1 or (body and not (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                                           and isinstance(body[0].value.value, str))):
            busy.append(rel(init))
    assert not busy, "a package __init__.py holds its docstring only:\n" + "\n".join(busy)


def _module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _defined_names(path: Path) -> set[str]:
    """Names a module defines at top level (in ``if``/``try`` blocks too); imported names are not among them."""
    names = {"__name__", "__file__", "__doc__", "__path__", "__spec__", "__all__"}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                              *[h.body for h in getattr(node, "handlers", [])]):
                    visit(block)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return names


def test_common_names_are_imported_from_the_module_that_defines_them():
    """``from common.x import Name`` names the module that defines ``Name`` (or a submodule of the package ``x``);
    so does ``alias.Name`` for a module imported as ``alias``. A re-export (the old protocol and config
    modules handed out 50 names this way) hides where a name is defined."""
    defined: dict[str, set[str]] = {}

    def defines(module: str, name: str) -> bool:
        if module not in defined:
            path = _module_file(module)
            defined[module] = _defined_names(path) if path else set()
        return name in defined[module] or _module_file(f"{module}.{name}") is not None

    bad = []
    for path in [*source_files(*ALL_CODE), REPO / "conftest.py"]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "common":
                for a in node.names:
                    if _module_file(f"{node.module}.{a.name}") is not None:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif a.name != "*" and not defines(node.module, a.name):
                        bad.append(f"{rel(path)}:{node.lineno}: {a.name} from {node.module}, which does not define it")
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("common.")})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and not defines(aliases[node.value.id], node.attr)):
                bad.append(f"{rel(path)}:{node.lineno}: {node.value.id}.{node.attr}: "
                           f"{aliases[node.value.id]} does not define {node.attr}")
    assert not bad, "import each name from the module that defines it:\n" + "\n".join(bad)


def test_the_weight_sync_map_names_only_files_that_exist():
    """common/weight_sync/__init__.py is where a reader starts on weight sync: every file its map names is there."""
    text = (REPO / "common" / "weight_sync" / "__init__.py").read_text(encoding="utf-8")
    named = set(re.findall(r"\b((?:common|learner|rollout_server|docs|tests)/[\w/]+\.(?:py|md))\b", text))
    assert len(named) >= 15, named
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, f"common/weight_sync/__init__.py names files that are not there: {missing}"
