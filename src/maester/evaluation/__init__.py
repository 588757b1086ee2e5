"""Downstream evaluation with EleutherAI's lm-evaluation-harness (the optional `eval` extra): a maester model as an
lm-eval `LM` (`harness_lm`), the tasks it runs (`task_specs`: lm-eval's, local YAML files, and the two tiny offline
tasks of `pydoc_tasks/`), and running them into results, metrics and lm-eval's table (`harness`). `maester eval`
(tools) and the trainer's in-loop evaluation (`maester.train.downstream`) both go through here. lm-eval is imported
by these modules, never by the ones that import them at module level."""


def require_lm_eval(who: str) -> None:
    """A ValueError that says how to install lm-eval, where it is missing; `who` names what needs it."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(f"{who} runs EleutherAI's lm-evaluation-harness, which is not installed: install maester's "
                         "`eval` extra (pip install 'maester[eval]', or uv sync --extra eval)") from None
