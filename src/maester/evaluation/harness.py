"""Running tasks on an `LM` with lm-eval's `simple_evaluate`, as its own command line does, and reading the results:
the metrics as flat `eval/<task>/<metric>` numbers, lm-eval's printed table, and its JSON."""

from __future__ import annotations

import contextlib
import json


def run_tasks(lm, specs: list, manager, *, limit: float | None = None, num_fewshot: int | None = None,
              log_samples: bool = False, bootstrap_iters: int = 100_000, environment: bool = True) -> dict | None:
    """lm-eval's results of `specs` (task names, or the objects `task_specs.load_tasks` built) on `lm` (seeds,
    few-shot handling and metrics as `lm_eval` sets them), or
    None on a process other than the first of its node, where lm-eval reports nothing. `limit`: documents per task
    (below 1: a share of them). `environment=False` leaves out the environment report (see below)."""
    from lm_eval import simple_evaluate

    with contextlib.nullcontext() if environment else _without_environment_report():
        return simple_evaluate(model=lm, tasks=list(specs), task_manager=manager, limit=limit,
                               num_fewshot=num_fewshot, log_samples=log_samples, bootstrap_iters=bootstrap_iters,
                               batch_size=lm.batch_size, device=str(lm.device))


@contextlib.contextmanager
def _without_environment_report():
    """simple_evaluate ends its results with the environment: `git describe` in the working directory (which prints
    "fatal: not a git repository" outside one) and torch's collect_env (pip, conda, nvidia-smi; 6 s on a busy 2-core
    machine). In the training loop that is paid per task at every evaluation, on rank 0 while the others wait, for
    facts the job's log already has; lm-eval has no switch for it, so its two functions are skipped meanwhile."""
    from lm_eval import evaluator

    names = [n for n in ("add_env_info", "get_git_commit_hash") if hasattr(evaluator, n)]
    saved = {n: getattr(evaluator, n) for n in names}
    try:
        for name in names:
            setattr(evaluator, name, lambda *args: None)
        yield
    finally:
        for name, function in saved.items():
            setattr(evaluator, name, function)


def flat_metrics(results: dict) -> dict[str, float]:
    """The results' numbers as `eval/<task or group>/<metric>`; a metric of a filter other than lm-eval's `none`
    keeps it after a comma, as lm-eval's own keys do (`eval/gsm8k/exact_match,strict-match`). Standard errors and
    text are left out."""
    out = {}
    for task, values in {**results.get("results", {}), **results.get("groups", {})}.items():
        for key, value in values.items():
            metric, _, kind = key.partition(",")
            if not kind or metric.endswith("_stderr") or isinstance(value, bool) or \
                    not isinstance(value, (int, float)):
                continue
            out[f"eval/{task}/{metric if kind == 'none' else key}"] = float(value)
    return out


def results_table(results: dict) -> str:
    """lm-eval's tables of the tasks (and of the groups, where there are any), as its command line prints them."""
    from lm_eval.utils import make_table

    return make_table(results) + (("\n" + make_table(results, "groups")) if results.get("groups") else "")


def results_json(results: dict) -> str:
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"
