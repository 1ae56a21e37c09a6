"""Imports flow down the layers of docs/architecture.md and never make a circle: every
import in `async_grpo/`, at module level or inside a function, read from the source."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "async_grpo"


def layers() -> dict[str, int]:
    """Top-level module or package -> its layer, from the table under "## Layers"."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    out: dict[str, int] = {}
    for line in section.splitlines():
        m = re.match(r"\| (\d+) \|[^|]*\|(.*)\|$", line)
        if m:
            for name in re.findall(r"`([\w]+)`", m.group(2)):
                out[name] = int(m.group(1))
    return out


def top(module: str) -> str:
    """`async_grpo.trainer.loop` -> `trainer`; the package itself -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports() -> dict[tuple[str, str], list[str]]:
    """(from, to) between different top-level names -> where (file:line)."""
    modules = {}
    for f in PACKAGE.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = f
    edges: dict[tuple[str, str], list[str]] = {}
    for name, f in modules.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and top(t) != top(name):
                    where = f"{f.relative_to(ROOT)}:{node.lineno}"
                    seen = edges.setdefault((top(name), top(t)), [])
                    if where not in seen:
                        seen.append(where)
    return edges


def test_every_module_has_a_layer():
    names = {top(".".join(f.relative_to(ROOT).with_suffix("").parts)) for f in PACKAGE.glob("*")
             if f.suffix == ".py" or (f / "__init__.py").is_file()}  # fmt: skip
    missing = sorted(names - set(layers()))
    assert not missing, f"not in docs/architecture.md's layer table: {missing}"
    assert not sorted(set(layers()) - names), "the table names modules that do not exist"


def test_imports_go_down_the_layers():
    layer = layers()
    up = [
        f"{a} (layer {layer[a]}) imports {b} (layer {layer[b]}) at {', '.join(where[:2])}"
        for (a, b), where in sorted(imports().items())
        if layer[b] < layer[a]
    ]
    assert not up, "\n".join(up)


def test_no_import_circle_between_packages():
    graph: dict[str, set[str]] = {}
    for a, b in imports():
        graph.setdefault(a, set()).add(b)
    circles, index, low, stack, on = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles
