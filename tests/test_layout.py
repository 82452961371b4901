"""The package's layout rules: the library never reaches into the experiments (nor names BFCL, which only the
experiments know), modules import one way (no cycle, function-level imports included), the results tools stay
out of the wheel's package, and the tests lie in folders named like the package's parts."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pask_jax"
EXPERIMENTS = PACKAGE / "experiments"
TESTS = Path(__file__).resolve().parent
# Test folders not named after a pask_jax module or subpackage: "api" holds the front doors' tests (llm, requests,
# batch, cli, the wheel, multi-host runs); "data" holds fixtures, no tests.
OTHER_TEST_FOLDERS = {"api", "data"}
LIBRARY_ENTRY = {"pask_jax.cli"}  # the command line registers the experiments' subcommands: the top of the order


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_files() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*")) if p.is_file() and EXPERIMENTS not in p.parents]


def imports_of(path: Path) -> set[str]:
    """Every pask_jax module `path` imports, at any level (module top, functions, TYPE_CHECKING blocks)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("pask_jax")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pask_jax"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from pask_jax import bfcl` names a module
    return out


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_nothing_outside_the_experiments_names_bfcl():
    offenders = [
        f"{p.relative_to(PACKAGE.parent)}:{i}"
        for p in library_files()
        if p.suffix in (".py", ".toml", ".json", ".md")
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if re.search("bfcl", line, re.IGNORECASE)
    ]
    assert not offenders, offenders


def test_the_library_never_imports_the_experiments():
    modules = package_modules()
    offenders = {
        name: sorted(i for i in imports_of(path) if i.startswith("pask_jax.experiments"))
        for name, path in modules.items()
        if not name.startswith("pask_jax.experiments") and name not in LIBRARY_ENTRY
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_no_import_cycles():
    modules = package_modules()
    graph = {
        name: {i for i in imports_of(path) if i in modules and i != name and not name.startswith(i + ".")}
        for name, path in modules.items()
    }
    # a package's __init__ importing its own submodules is its public face, not a cycle
    graph = {n: {i for i in deps if not i.startswith(n + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_the_results_tools_are_not_in_the_package():
    assert not (PACKAGE / "report.py").exists()
    assert (PACKAGE.parent / "tools" / "report" / "__init__.py").exists()


def test_tests_mirror_the_package():
    """Every test file lies in a folder named like the part of pask_jax it tests; only this file stays at the top."""
    stray = sorted(p.name for p in TESTS.glob("test_*.py") if p.name != Path(__file__).name)
    assert not stray, f"test files at tests/ top (move each into the folder of what it tests): {stray}"
    package_names = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    unknown = sorted(folders - package_names - OTHER_TEST_FOLDERS)
    assert not unknown, f"test folders named after no pask_jax module (nor in OTHER_TEST_FOLDERS): {unknown}"
