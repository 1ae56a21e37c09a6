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


def package_modules() -> dict[str, Path]:
    """Every module of `async_grpo/` by its dotted name (a package by its own) -> its file."""
    modules = {}
    for f in PACKAGE.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = f
    return modules


def imports() -> dict[tuple[str, str], list[str]]:
    """(from, to) between different top-level names -> where (file:line)."""
    modules = package_modules()
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


def worker_modules() -> list[str]:
    """The modules of every pool worker class (`...Worker`, and what derives from one): a
    registry, the batcher and the run's supervisor get handles of these actors."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for module, f in package_modules().items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                classes[node.name] = (module, bases)
    workers = {n for n in classes if n.endswith("Worker") and not n.startswith("_")}
    while more := {n for n, (_, bases) in classes.items() if set(bases) & workers} - workers:
        workers |= more
    return sorted({classes[n][0] for n in workers})


def test_a_worker_handle_costs_its_holder_no_torch():
    """Ray imports an actor's module in every process that gets its handle: a registry
    (a worker registers itself), the batcher, the run's supervisor. Each worker module
    imports torch, transformers and vLLM where it uses them, not at its top: at the top,
    torch cost two registries about 2 CPU s each in every whole run (AVX512-BF16 EPYC,
    py-spy in a registry: `_load_actor_class_from_gcs` -> `inference/logprob.py`)."""
    import subprocess
    import sys

    modules = worker_modules()
    assert "async_grpo.inference.generation" in modules and len(modules) >= 6, modules
    code = (
        f"import sys; import {', '.join(modules)};"
        " print([m for m in ('torch', 'transformers', 'vllm') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])
