"""`maester eval JOB_OR_CHECKPOINT --tasks ...`: lm-evaluation-harness tasks on a job's latest checkpoint (or a
checkpoint, or a Hugging Face model directory) with the model and tokenizer as they are, no export first
(`maester.evaluation`). Under torchrun every process holds the whole model and takes its share of the requests
(data parallel); rank 0 prints lm-eval's table and writes the JSON. `--download-only` loads the tasks' data and
stops: on a login node it fills the Hugging Face cache for compute nodes without internet, and there, with
`HF_DATASETS_OFFLINE=1`, it shows the cache holds every task."""

from __future__ import annotations

import sys
from pathlib import Path

INSTALL_HINT = ("maester eval runs EleutherAI's lm-evaluation-harness, which is not installed: install maester's "
                "`eval` extra (pip install 'maester[eval]', or uv sync --extra eval)")


def require_lm_eval() -> None:
    """A clear error (exit 2) where the optional lm-eval package is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(INSTALL_HINT) from None


def evaluate_target(target: str, tasks: list[str], *, limit: float | None = None, batch_size: int = 8,
                    num_fewshot: int | None = None, output: str | None = None, device: str = "auto",
                    dtype: str = "auto", include_paths: list[str] = (), log_samples: bool = False) -> dict | None:
    """lm-eval's results of `tasks` on the model of `target` (on rank 0; None elsewhere), written to `output` as
    JSON when given. The tasks and `output` are checked before the model loads; the checkpoint evaluated is
    printed and recorded in the JSON (`config.checkpoint`, `config.step`)."""
    require_lm_eval()
    from maester.evaluation.harness import results_json, run_tasks
    from maester.evaluation.harness_lm import MaesterLM, Ranks
    from maester.evaluation.task_specs import load_tasks, task_manager
    from maester.files import check_writable, write_atomically
    from maester.tools.generate import read_for_inference, start_inference

    manager = task_manager(tasks, "--tasks", include_paths)
    built = load_tasks(manager, tasks, "--tasks")  # a bad task is refused before the model loads
    if output:
        check_writable(Path(output), "--output")  # not hours later, with the results
    device_, dtype_, _, rank = start_inference(device, dtype, tensor_parallel=False)
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    loaded = read_for_inference(target, device_, dtype_)
    if rank == 0:
        print(f"evaluating {loaded.describe()}", file=sys.stderr, flush=True)
    model, cfg = loaded.model, loaded.cfg
    info = {"target": str(target), "checkpoint": str(loaded.source), "step": loaded.step,
            "model": f"{cfg.model.name}/{cfg.model.flavor}", "dtype": str(dtype_),
            "model_num_parameters": sum(p.numel() for p in model.parameters()), "processes": world}
    lm = MaesterLM(model, loaded.tokenizer, device=device_, add_bos=cfg.data.add_bos, batch_size=batch_size,
                   ranks=Ranks(rank, world), info=info)
    results = run_tasks(lm, built, manager, limit=limit, num_fewshot=num_fewshot, log_samples=log_samples)
    if rank != 0:
        return None
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(Path(output), results_json(results))
    return results


def download_tasks(tasks: list[str], include_paths: list[str] = ()) -> list[str]:
    """Load every task's documents (a Hub task's data lands in the Hugging Face cache): one line per task."""
    require_lm_eval()
    from maester.evaluation.task_specs import load_tasks, task_manager

    built = load_tasks(task_manager(tasks, "--tasks", include_paths), tasks, "--tasks")
    leaves = [task for item in built for task in (item.get_all_tasks() if hasattr(item, "get_all_tasks") else [item])]
    return [f"{task.task_name}: {len(task.eval_docs)} documents to evaluate" for task in leaves]
