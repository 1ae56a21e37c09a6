import ast
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (REPO / ".venv/bin/ruff").exists(),
    reason="ruff is in the dev extra",
)
def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(REPO / ".venv/bin/ruff")
    r = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:]


def _is_fixture(node: ast.AST) -> bool:
    """Whether a function is decorated with `pytest.fixture` (called or bare)."""
    for d in getattr(node, "decorator_list", []):
        d = d.func if isinstance(d, ast.Call) else d
        if (isinstance(d, ast.Attribute) and d.attr == "fixture") or (
            isinstance(d, ast.Name) and d.id == "fixture"
        ):
            return True
    return False


def _bound(fn: ast.AST) -> set[str]:
    """The names a function binds itself: its parameters and what it assigns or imports."""
    a = fn.args
    names = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
    names |= {p.arg for p in (a.vararg, a.kwarg) if p is not None}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.alias):
            names.add((n.asname or n.name).split(".")[0])
    return names


def _global_fixture_reads(tree: ast.Module, fixtures: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every read of a module fixture's name inside a function that does
    not bind it: such a read gets pytest's fixture definition object, not its value."""
    found = []

    def visit(node: ast.AST, bound: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, bound | _bound(child))
            elif isinstance(child, ast.ClassDef):
                visit(child, bound)
            else:
                if (
                    isinstance(child, ast.Name)
                    and isinstance(child.ctx, ast.Load)
                    and child.id in fixtures
                    and child.id not in bound
                ):
                    found.append((child.lineno, child.id))
                visit(child, bound)

    for top in tree.body:
        if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef):
            visit(top, _bound(top))
        elif isinstance(top, ast.ClassDef):
            for m in top.body:
                if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef):
                    visit(m, _bound(m))
    return found


def test_no_test_reads_a_fixture_as_a_global():
    """A test or helper that names a module's fixture without taking it as a parameter
    reads pytest's definition object (`'FixtureFunctionDefinition' object has no
    attribute ...`), and only when that test runs: ruff sees a defined global. Every test
    file is checked here, in the unit tier, so the integration tier cannot be the first to
    find it."""
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        fixtures = {n.name for n in tree.body if _is_fixture(n)}
        bad += [f"{path.relative_to(REPO)}:{line}: {name}" for line, name in
                _global_fixture_reads(tree, fixtures)]  # fmt: skip
    assert not bad, "a fixture read as a global (take it as a parameter):\n" + "\n".join(bad)
