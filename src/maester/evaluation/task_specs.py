"""Which tasks a run names: lm-eval task (or group, or tag) names, and local task YAML files. The two tiny offline
tasks that ship here (`pydoc_choice`, `pydoc_complete`, in `pydoc_tasks/`) are known by name everywhere.

lm-eval's own index of its thousands of task files takes seconds to build, so it is built only when a name is
neither a shipped task nor in an `include_path` directory. A Hub task's data is read through `datasets`, which
honours `HF_DATASETS_OFFLINE`, `HF_HUB_OFFLINE`, `HF_HOME` and `HF_DATASETS_CACHE` (docs/evaluation.md)."""

from __future__ import annotations

import contextlib
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


def load_tasks(manager, specs: list[str], where: str) -> list:
    """lm-eval's objects (tasks and groups) of every one of `specs`, each built with its data read and its first
    document rendered through its templates, so that a task file that does not parse, a template or metric that
    lm-eval refuses, or a Hub dataset missing offline is an error naming the task and `where` before any model is
    loaded. The objects can be evaluated as they are (`simple_evaluate` takes them)."""
    built = []
    for spec in specs:
        with _lm_eval_warnings() as warnings:
            try:
                loaded = manager.load([spec])
                for task in loaded["tasks"].values():
                    _render_first_document(task)
            except Exception as e:  # a task file is code (its !function), whatever it raises is its error
                raise ValueError(_task_error(spec, where, e, warnings)) from None
        children = {name for names in loaded["group_map"].values() for name in names}
        groups = [group for name, group in loaded["groups"].items() if name not in children]
        grouped = {task.task_name for group in groups for task in group.get_all_tasks()}
        built += groups + [task for name, task in loaded["tasks"].items() if name not in grouped]
    return built


class TemplateFailed(Exception):
    """A task's template failed on its first document: `field` is the task key that holds it."""

    def __init__(self, task: str, field: str, error: Exception):
        super().__init__(f"the task {task}'s {field} fails on its first document: {error}")


def _render_first_document(task) -> None:
    docs = task.eval_docs
    if not len(docs):
        return
    choices = getattr(task.config, "output_type", None) == "multiple_choice"
    fields = ["doc_to_text", "doc_to_target"] + (["doc_to_choice"] if choices else [])
    for field in fields:
        try:
            getattr(task, field)(docs[0])
        except Exception as e:
            raise TemplateFailed(task.task_name, field, e) from e


def _task_error(spec: str, where: str, error: Exception, warnings: list[str]) -> str:
    import jinja2
    import yaml

    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        return (f"{where}: {mark.name}: cannot be read as YAML at line {mark.line + 1}, column {mark.column + 1}: "
                f"{error.problem or error.context}")
    if isinstance(error, ConnectionError):
        from datasets import config

        return (f"{where}: {spec}: its data is not in the Hugging Face cache ({config.HF_DATASETS_CACHE}) and the Hub "
                f"cannot be reached ({_first_line(error)}): run `maester eval --download-only --tasks {spec}` where "
                f"there is internet, with the HF_HOME of this machine (docs/evaluation.md, nodes without internet)")
    if isinstance(error, TemplateFailed):
        return f"{where}: {spec}: {_first_line(error)}"
    if isinstance(error, jinja2.TemplateError):
        return f"{where}: {spec}: a template of the task fails: {type(error).__name__}: {_first_line(error)}"
    said = f" (lm-eval warned: {warnings[-1]})" if warnings and isinstance(error, KeyError) else ""
    return f"{where}: {spec}: lm-eval cannot build the task: {type(error).__name__}: {_first_line(error)}{said}"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@contextlib.contextmanager
def _lm_eval_warnings():
    """The warnings lm-eval logs meanwhile (a metric it does not know is named in a warning before its KeyError)."""
    import logging

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(_first_line(Exception(record.getMessage())))

    handler, logger = Keep(logging.WARNING), logging.getLogger("lm_eval")
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
