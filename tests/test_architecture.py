"""The package's imports, read from the source: no import cycle among modules beyond the ones still listed in
`KNOWN_CYCLES` (debt being paid down: the list may only shrink), and none at all inside `data/`.

Both module-level and function-local imports count: a function-local import that closes a circle is still a
circle, only hidden from Python's import machinery."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "maester"

# Cycles that remain, each as its sorted members; issue 18 removes them. A new cycle, or a larger one, fails.
KNOWN_CYCLES: set[frozenset[str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports, at any depth of its code (`from a import b` counts `a.b` when that is a
    module, else `a`)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != "maester":
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: imports_of(path, modules) for name, path in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_new_import_cycle():
    found = set(cycles(graph()))
    new = [sorted(c) for c in found - KNOWN_CYCLES]
    assert not new, f"import cycles beyond the known ones: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES - found]
    assert not gone, f"these known cycles are gone: remove them from KNOWN_CYCLES: {gone}"


def test_data_has_no_cycle_and_its_batch_is_the_bottom():
    edges = graph()
    data = {k: {w for w in v if w.startswith("maester.data.")} for k, v in edges.items()
            if k.startswith("maester.data.")}
    assert cycles(data) == []
    assert {w for w in edges["maester.data.batch"] if w.startswith("maester.")} <= {"maester.models.layers"}


def test_loaders_are_below_the_loader_choice():
    edges = graph()
    for loader in ("maester.data.sft", "maester.data.text_stream", "maester.data.token_stream"):
        assert "maester.data.loader" not in edges[loader], loader
    by_layer = defaultdict(set)
    for k in edges:
        by_layer[k.split(".")[1] if k.count(".") else k].add(k)
    assert by_layer["data"]  # the walk saw the package
