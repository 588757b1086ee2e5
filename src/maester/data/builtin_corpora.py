"""Corpora that ship with Python itself, written to Parquet on first use, so the demo needs no download."""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
from pathlib import Path

from maester.files import AtomicOutputs


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "maester" / "corpora"


def pydoc_documents() -> list[str]:
    """The interpreter's help topics, then the docstrings of the standard library's top-level modules."""
    from pydoc_data.topics import topics

    docs = [topics[key] for key in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue  # a broken file in a local stdlib is not the demo's problem; the corpus just omits it
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    docs.append(doc)
    return docs


def _signature(node) -> str:
    if isinstance(node, ast.ClassDef):
        return f"class {node.name}"
    args = ast.unparse(node.args)
    return f"{node.name}({args if len(args) <= 60 else '...'})"


def pydoc_conversations() -> list[str]:
    """Questions about the standard library's public functions and classes, answered with the signature and the
    first paragraph of the docstring; two neighbours of a module make one two-turn conversation. Each is the JSON
    of a [{role, content}] list."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    conversations = []
    for path in sorted(p for p in stdlib.glob("*.py") if not p.stem.startswith("_")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        items = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = (ast.get_docstring(node) or "").split("\n\n")[0].replace("\n", " ").strip()
                if 20 <= len(doc) <= 300 and ">>>" not in doc:
                    items.append((f"{path.stem}.{node.name}", f"`{path.stem}.{_signature(node)}`: {doc}"))
        for i in range(0, len(items), 2):
            turns = [{"role": "user", "content": f"What does `{items[i][0]}` do?"},
                     {"role": "assistant", "content": items[i][1]}]
            if i + 1 < len(items):
                turns += [{"role": "user", "content": f"And `{items[i + 1][0]}`?"},
                          {"role": "assistant", "content": items[i + 1][1]}]
            conversations.append(json.dumps(turns))
    return conversations


# name -> (column, rows, revision); a new revision of a generator gets a new cache file
BUILTIN = {"pydoc": ("text", pydoc_documents, 1), "pydoc-chat": ("messages", pydoc_conversations, 1)}


def materialize_builtin(name: str) -> Path:
    """Path of the built-in corpus `name` as Parquet (one column: `text`, or `messages` for conversations),
    written atomically once."""
    if name not in BUILTIN:
        raise ValueError(f"unknown built-in corpus {name!r} (available: {', '.join(BUILTIN)})")
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    column, rows, revision = BUILTIN[name]
    path = cache_dir() / f"{name}-{version}-r{revision}.parquet"
    if path.exists():
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    with AtomicOutputs() as out:
        pq.write_table(pa.table({column: rows()}), out.temp_for(path))
    return path
