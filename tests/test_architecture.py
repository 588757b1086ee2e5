"""The package's imports, read from the source: no import cycle among modules (beyond the ones listed in
`KNOWN_CYCLES`, none today: the list may only shrink), and no import from a lower layer to a higher one, in the
order of `LAYERS`.

Both module-level and function-local imports count: a function-local import that closes a circle is still a
circle, only hidden from Python's import machinery. Imports under `if TYPE_CHECKING:` do not: they name types
for the reader and the type checker and are never executed."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "maester"

# Cycles that remain, each as the set of its modules. A new cycle, or a larger one, fails.
KNOWN_CYCLES: set[frozenset[str]] = set()

# Bottom to top: a module may import its own layer and the ones below it.
LAYERS = [
    # the ground floor: files, progress bars, the config sections' base class and error messages, exit codes, Hub ids,
    # durations as text, the GPU's defaults
    ("maester.files", "maester.progress", "maester.config.base", "maester.exit_codes", "maester.hub", "maester.cpus",
     "maester.durations", "maester.gpu_defaults"),
    ("maester.models",),  # the single-device model, its loss, HF name maps, its config sections
    # the tree, its sections, its sources (`maester.config.base` is on the ground floor, listed first); the
    # combinations of settings maester refuses
    ("maester.config", "maester.combinations"),
    # loaders; device meshes, sharding, precision, preflight; lm-evaluation-harness: the model as its LM, the tasks
    ("maester.data", "maester.parallel", "maester.evaluation"),
    ("maester.train",),  # the trainer, checkpoints, optimizers, metrics
    ("maester.plan",),  # memory and time of a config's step before the queue, on fake tensors
    ("maester.jobs",),  # job directories, SLURM scripts, sweeps
    ("maester.tools",),  # data tools, convert, generate, reports
    ("maester.cli", "maester.__main__"),  # the command
]


def layer_of(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports, at any depth of its code (`from a import b` counts `a.b` when that is a
    module, else `a`)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                 for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
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


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


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
    assert edges["maester.data.batch"] <= {"maester.models.layers", "maester.models.loss"}


def test_no_import_runs_up_the_layers():
    edges = graph()
    upward = sorted(f"{a} -> {b}" for a, targets in edges.items() if a != "maester" for b in targets
                    if layer_of(b) > layer_of(a))
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import():
    assert layer_of("maester.models.build") < layer_of("maester.config")
    assert layer_of("maester.train.trainer") > layer_of("maester.parallel.preflight")


def test_loaders_are_below_the_loader_choice():
    edges = graph()
    for loader in ("maester.data.sft_loader", "maester.data.text_loader", "maester.data.token_loader",
                   "maester.data.loader_base"):
        assert "maester.data.loader" not in edges[loader], loader
    assert {"maester.data.sft_loader", "maester.data.text_loader", "maester.data.token_loader"} <= edges[
        "maester.data.loader"]


# Sizes a newcomer can read: modules and functions, with the declarative tables and plots named.
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_TRAIN_LINES = 600, 80, 40
LONG_FUNCTIONS_ALLOWED: set[tuple[str, str]] = set()  # (module, function) pairs; none now


def function_lengths() -> list[tuple[str, str, int]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((module_name(path), node.name, node.end_lineno - node.lineno + 1))
    return found


def test_no_module_over_600_lines():
    long = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_80_lines_and_a_short_training_loop():
    lengths = function_lengths()
    long = [(m, f, n) for m, f, n in lengths if n > MAX_FUNCTION_LINES and (m, f) not in LONG_FUNCTIONS_ALLOWED]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
    train = [n for m, f, n in lengths if (m, f) == ("maester.train.trainer", "train")]
    assert train and train[0] <= MAX_TRAIN_LINES, train
