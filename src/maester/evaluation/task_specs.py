"""Which tasks a run names: lm-eval task (or group, or tag) names, and local task YAML files. The two tiny offline
tasks that ship here (`pydoc_choice`, `pydoc_complete`, in `pydoc_tasks/`) are known by name everywhere.

lm-eval's own index of its thousands of task files takes seconds to build, so it is built only when a name is
neither a shipped task nor in an `include_path` directory. A Hub task's data is read through `datasets`, which
honours `HF_DATASETS_OFFLINE`, `HF_HUB_OFFLINE`, `HF_HOME` and `HF_DATASETS_CACHE` (docs/evaluation.md)."""

from __future__ import annotations

import difflib
from pathlib import Path

SHIPPED_TASKS = Path(__file__).parent / "pydoc_tasks"
"""The directory of the shipped task YAMLs and their JSONL data."""


def is_task_file(spec: str) -> bool:
    return spec.endswith((".yaml", ".yml"))


def check_task_files(specs: list[str], where: str) -> None:
    """Every task file `specs` name exists (`where`: the option or key that named them, for the message)."""
    for spec in specs:
        if is_task_file(spec) and not Path(spec).is_file():
            raise FileNotFoundError(f"{where}: the task file {spec} does not exist")


def task_manager(specs: list[str], where: str, include_paths: list[str] = ()):
    """An lm-eval TaskManager that knows every one of `specs`; an unknown name is an error naming `where`."""
    from lm_eval.tasks import TaskManager

    check_task_files(specs, where)
    for path in include_paths:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"{where}: the task directory {path} does not exist")
    paths = [str(SHIPPED_TASKS), *map(str, include_paths)]
    names = [spec for spec in specs if not is_task_file(spec)]
    manager = TaskManager(include_path=paths, include_defaults=False)
    if any(name not in manager.all_tasks for name in names):
        manager = TaskManager(include_path=paths, include_defaults=True)
    for name in names:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else "`lm-eval ls tasks` lists them"
            raise ValueError(f"{where}: {name!r} is no lm-eval task, group or tag, nor a task file ending in .yaml "
                             f"({hint})")
    return manager
