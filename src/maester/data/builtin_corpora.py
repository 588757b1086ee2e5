"""Corpora that ship with Python itself, written to Parquet on first use, so the demo needs no download."""

from __future__ import annotations

import ast
import os
import sys
import sysconfig
from pathlib import Path


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


BUILTIN = {"pydoc": pydoc_documents}


def materialize_builtin(name: str) -> Path:
    """Path of the built-in corpus `name` as Parquet (column `text`), written atomically once."""
    if name not in BUILTIN:
        raise ValueError(f"unknown built-in corpus {name!r} (available: {', '.join(BUILTIN)})")
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    path = cache_dir() / f"{name}-{version}.parquet"
    if path.exists():
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    pq.write_table(pa.table({"text": BUILTIN[name]()}), tmp)
    os.replace(tmp, path)
    return path
