"""The package's layers, checked on its source with ``ast`` (nothing is imported).

Every ``tokenmill.*`` import counts, wherever it is: at module level, inside a function, under
``if TYPE_CHECKING:`` (a static circle is still a circle to a reader and to mypy). Relative imports
are resolved against the importing module. The graph's nodes are the subpackages (``core``,
``server``, ...), the top-level modules (``config``, ``protocol``, ...) and the package itself;
``tokenmill.core.step_io`` is a node of its own, because the plan types are the core's leaf that
workers, layers and the grammar code share with it (DESIGN.md section 9).

Rules:
  a. no import circle among those nodes;
  b. ``layers``, ``models``, ``worker`` and ``sample`` import nothing of the core but ``core.step_io``;
  c. ``server`` imports nothing of the core but the engine client (``core.client``);
  d. ``config.py`` imports nothing of the core;
  e. ``core/step_io.py`` imports nothing else of the core;
  f. no file in ``core/`` over ``MAX_CORE_FILE_LINES`` lines, no function there over
     ``MAX_CORE_FUNCTION_LINES``.

Each rule's checker is run on a synthetic package too, so that none passes vacuously.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "tokenmill"

# Modules that are graph nodes of their own rather than part of their subpackage's node.
LEAF_MODULES = frozenset({"tokenmill.core.step_io"})
MAX_CORE_FILE_LINES = 600
MAX_CORE_FUNCTION_LINES = 150

Imports = dict[str, dict[str, int]]  # importer module -> {imported module: first line}


# ---------------------------------------------------------------------------------------- checkers


def module_name(path: Path, package_dir: Path) -> str:
    """``tokenmill.core.scheduler`` for ``<package_dir>/core/scheduler.py``; a package's
    ``__init__.py`` is the package itself."""
    parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect_imports(package_dir: Path) -> Imports:
    """Every module of the package under ``package_dir`` with the package's modules it imports.

    ``from a.b import c`` counts as importing ``a.b.c`` when that is a module of the package, else
    ``a.b``. Imports of other packages are left out.
    """
    root = package_dir.name
    paths = sorted(package_dir.rglob("*.py"))
    modules = {module_name(p, package_dir): p for p in paths}
    imports: Imports = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        found: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.append(submodule if submodule in modules else base)
            for target in targets:
                if target == root or target.startswith(root + "."):
                    found.setdefault(target, node.lineno)
        imports[name] = found
    return imports


def graph_node(module: str) -> str:
    """The node of the layer graph ``module`` belongs to (see the module docstring)."""
    if module in LEAF_MODULES:
        return module.split(".", 1)[1]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def import_edges(imports: Imports, pending: Iterable[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The edges between distinct graph nodes, each with one import that makes it
    (``importer:line -> imported``), leaving out the ``pending`` pairs."""
    skipped = set(pending)
    edges: dict[tuple[str, str], str] = {}
    for importer, targets in sorted(imports.items()):
        for imported, line in sorted(targets.items()):
            edge = (graph_node(importer), graph_node(imported))
            if edge[0] != edge[1] and (importer, imported) not in skipped:
                edges.setdefault(edge, f"{importer}:{line} -> {imported}")
    return edges


def find_cycle(edges: Iterable[tuple[str, str]]) -> list[str] | None:
    """One cycle of the directed graph as ``[a, b, ..., a]``, or None when it has none."""
    successors: dict[str, list[str]] = {}
    for source, target in sorted(edges):
        successors.setdefault(source, []).append(target)
    done: set[str] = set()
    for start in sorted(successors):
        if start in done:
            continue
        # Iterative depth-first search; ``path`` is the chain of nodes being explored.
        path, on_path = [start], {start}
        stack = [iter(successors.get(start, []))]
        while stack:
            target = next(stack[-1], None)
            if target is None:
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                stack.pop()
                continue
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target not in done:
                path.append(target)
                on_path.add(target)
                stack.append(iter(successors.get(target, [])))
    return None


def forbidden_imports(
    imports: Imports,
    importers: Iterable[str],
    forbidden: str,
    allowed: Iterable[str] = (),
    pending: Iterable[tuple[str, str]] = (),
) -> list[str]:
    """Imports of ``forbidden`` or its submodules (but not of ``allowed`` ones) by ``importers``
    (modules, with their submodules), as ``importer:line -> imported``."""
    importer_prefixes = tuple(importers)
    allowed_set, skipped = set(allowed), set(pending)
    found = []
    for importer, targets in sorted(imports.items()):
        if not any(importer == p or importer.startswith(p + ".") for p in importer_prefixes):
            continue
        for imported, line in sorted(targets.items()):
            hit = imported == forbidden or imported.startswith(forbidden + ".")
            if hit and imported not in allowed_set and (importer, imported) not in skipped:
                found.append(f"{importer}:{line} -> {imported}")
    return found


def oversized(directory: Path, max_file_lines: int, max_function_lines: int) -> list[str]:
    """Files under ``directory`` longer than ``max_file_lines`` and functions (methods and nested
    functions included, from ``def`` to their last line) longer than ``max_function_lines``."""
    found = []
    for path in sorted(directory.rglob("*.py")):
        source = path.read_text()
        num_lines = len(source.splitlines())
        if num_lines > max_file_lines:
            found.append(f"{path}: {num_lines} lines")
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > max_function_lines:
                    found.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return found


# ------------------------------------------------------------------------------ the rules, on tokenmill

CORE = "tokenmill.core"
STEP_IO = "tokenmill.core.step_io"


@pytest.fixture(scope="module")
def imports() -> Imports:
    return collect_imports(PACKAGE_DIR)


def test_collector_reads_the_real_package(imports: Imports) -> None:
    # Guards every rule below against passing on an empty or misread tree.
    assert len(imports) > 50
    assert "tokenmill.core.step_io" in imports["tokenmill.core.scheduler"]
    assert "tokenmill.structured.manager" in imports["tokenmill.core.engine_core"]


def test_no_import_circle_among_subpackages(imports: Imports) -> None:
    edges = import_edges(imports, ())
    cycle = find_cycle(edges)
    if cycle is not None:
        steps = [f"  {edges[(a, b)]}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import circle " + " -> ".join(cycle) + ":\n" + "\n".join(steps))


def test_model_side_imports_only_plan_types_of_the_core(imports: Imports) -> None:
    importers = [f"tokenmill.{p}" for p in ("layers", "models", "worker", "sample")]
    found = forbidden_imports(imports, importers, CORE, allowed=[STEP_IO])
    assert not found, "the model side may import only core.step_io of the core:\n" + "\n".join(found)


def test_server_imports_only_the_engine_client_of_the_core(imports: Imports) -> None:
    allowed = ["tokenmill.core.client"]
    found = forbidden_imports(imports, ["tokenmill.server"], CORE, allowed=allowed)
    assert not found, "the server may import only core.client of the core:\n" + "\n".join(found)


def test_config_imports_nothing_of_the_core(imports: Imports) -> None:
    found = forbidden_imports(imports, ["tokenmill.config"], CORE)
    assert not found, "config.py may not import the core:\n" + "\n".join(found)


def test_plan_types_are_a_leaf_of_the_core(imports: Imports) -> None:
    found = forbidden_imports(imports, [STEP_IO], CORE, allowed=[STEP_IO])
    assert not found, "core/step_io.py may not import the rest of the core:\n" + "\n".join(found)


def test_core_files_and_functions_are_small() -> None:
    found = oversized(PACKAGE_DIR / "core", MAX_CORE_FILE_LINES, MAX_CORE_FUNCTION_LINES)
    assert not found, "split these by feature:\n" + "\n".join(found)


def write_package(root: Path, files: dict[str, str]) -> Path:
    """A package ``tokenmill`` under ``root`` with ``files`` (relative path -> source); every
    directory on the way gets an ``__init__.py``."""
    package_dir = root / "tokenmill"
    for relative, source in {"__init__.py": "", **files}.items():
        path = package_dir / relative
        for parent in [path.parent, *path.parent.parents]:
            if parent == root:
                break
            parent.mkdir(parents=True, exist_ok=True)
            (parent / "__init__.py").touch()
        path.write_text(source)
    return package_dir


def test_collect_imports_sees_every_form(tmp_path: Path) -> None:
    package_dir = write_package(
        tmp_path,
        {
            "core/step_io.py": "",
            "core/a.py": (
                "from typing import TYPE_CHECKING\n"
                "import os\n"
                "from . import step_io\n"
                "from .. import config\n"
                "if TYPE_CHECKING:\n"
                "    from tokenmill.server.app import App\n"
                "def f():\n"
                "    import tokenmill.worker.runner\n"
            ),
            "config.py": "",
            "server/app.py": "App = 1\n",
            "worker/runner.py": "",
        },
    )
    found = collect_imports(package_dir)["tokenmill.core.a"]
    assert set(found) == {
        "tokenmill.core.step_io",
        "tokenmill.config",
        "tokenmill.server.app",
        "tokenmill.worker.runner",
    }
    assert found["tokenmill.worker.runner"] == 8


def test_cycle_checker_finds_a_circle_through_a_type_checking_import(tmp_path: Path) -> None:
    package_dir = write_package(
        tmp_path,
        {
            "core/step_io.py": "",
            "core/request.py": "if False:\n    from tokenmill.structured.manager import State\n",
            "structured/manager.py": "from tokenmill.core.request import Request\n",
            "worker/runner.py": "from tokenmill.core.step_io import Plan\n",
            "core/engine.py": "from tokenmill.worker.runner import Runner\n",
        },
    )
    imports = collect_imports(package_dir)
    edges = import_edges(imports, ())
    cycle = find_cycle(edges)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"core", "structured"}
    # The plan types' leaf node makes core -> worker -> core.step_io no circle.
    pending = [("tokenmill.structured.manager", "tokenmill.core.request")]
    assert find_cycle(import_edges(imports, pending)) is None


def test_forbidden_import_checker_honours_allowed_and_pending(tmp_path: Path) -> None:
    package_dir = write_package(
        tmp_path,
        {
            "core/step_io.py": "",
            "core/scheduler.py": "",
            "layers/linear.py": "from tokenmill.core.step_io import Plan\n",
            "models/llama.py": "from tokenmill.core import scheduler\n",
        },
    )
    imports = collect_imports(package_dir)
    importers = ["tokenmill.layers", "tokenmill.models"]
    found = forbidden_imports(imports, importers, CORE, allowed=[STEP_IO])
    assert found == ["tokenmill.models.llama:1 -> tokenmill.core.scheduler"]
    pending = [("tokenmill.models.llama", "tokenmill.core.scheduler")]
    assert forbidden_imports(imports, importers, CORE, allowed=[STEP_IO], pending=pending) == []


def test_size_checker_finds_long_files_and_functions(tmp_path: Path) -> None:
    method = "    def long(self):\n" + "".join(f"        x{i} = {i}\n" for i in range(5))
    package_dir = write_package(tmp_path, {"core/big.py": "class C:\n" + method})
    found = oversized(package_dir / "core", max_file_lines=7, max_function_lines=5)
    assert found == [f"{package_dir / 'core' / 'big.py'}:2 long: 6 lines"]
    found = oversized(package_dir / "core", max_file_lines=5, max_function_lines=6)
    assert found == [f"{package_dir / 'core' / 'big.py'}: 7 lines"]
