"""In-loop downstream evaluation (`evaluation.tasks`): lm-evaluation-harness tasks on the training model as it is
sharded, every `evaluation.interval` steps and at the last step (OLMo-core's `DownstreamEvaluatorCallback` runs
its tasks on the FSDP train module the same way, each data-parallel rank taking its share).

The data-parallel ranks split each call's requests (`maester.evaluation.harness_lm.Ranks`); the ranks of one
data-parallel replica (TP) take the same ones, and every rank runs its forwards in step with the others, since each
forward gathers sharded weights. Compiled blocks run eagerly here: the requests' shapes vary. The tasks run one at
a time; a task that fails is logged and the others still run. The random number generators are left as they were
(lm-eval seeds them), so an evaluation changes nothing in training: a run resumed from a checkpoint trains the same
steps as one that never stopped, evaluated or not.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from maester.config import Config
from maester.data.tokenizers import Tokenizer
from maester.parallel.dims import ParallelDims
from maester.parallel.precision import Precision, autocast

log = logging.getLogger("maester")


class DownstreamEvaluation:
    """The tasks of `cfg.evaluation`, checked when built (task files exist and parse, names are known, each task
    builds with its data and renders its first document, lm-eval is installed): the first evaluation does not find
    out hours into a run."""

    def __init__(self, cfg: Config, model: nn.Module, tokenizer: Tokenizer, dims: ParallelDims,
                 device: torch.device, precision: Precision):
        from maester.evaluation.task_specs import check_task_files

        self.cfg, self.model, self.device, self.precision = cfg.evaluation, model, device, precision
        check_task_files(self.cfg.tasks, "evaluation.tasks")
        try:
            from maester.evaluation.harness_lm import MaesterLM, Ranks
            from maester.evaluation.task_specs import load_tasks, task_manager
        except ImportError:
            raise ValueError("evaluation.tasks runs EleutherAI's lm-evaluation-harness, which is not installed: "
                             "install maester's `eval` extra (pip install 'maester[eval]', or uv sync --extra "
                             "eval)") from None
        self.manager = task_manager(self.cfg.tasks, "evaluation.tasks")
        load_tasks(self.manager, self.cfg.tasks, "evaluation.tasks")  # built once now: each evaluation builds anew
        split = dims.world_size > 1 and dims.dp_size > 1
        ranks = Ranks(rank=dims.dp_rank if split else 0, size=dims.dp_size if split else 1,
                      group=dims.submesh("dp").get_group() if split else None, in_step=dims.world_size > 1)
        self.lm = MaesterLM(model, tokenizer, device=device, add_bos=cfg.data.add_bos,
                            batch_size=self.cfg.batch_size, ranks=ranks,
                            forward_context=lambda: autocast(precision, device), cache_dtype=precision.compute_dtype,
                            seq_multiple=dims.tp, progress=False)

    def due(self, step: int, total: int) -> bool:
        return bool(self.cfg.tasks) and ((self.cfg.interval and step % self.cfg.interval == 0) or step == total)

    def run(self) -> tuple[dict[str, float], list[dict]]:
        """Every rank runs every task: (the metrics, `eval/<task>/<metric>`, on rank 0; the failures, each
        {"task", "error"}, the same on every rank)."""
        from maester.evaluation.harness import flat_metrics, run_tasks

        metrics: dict[str, float] = {}
        failures = []
        for spec in self.cfg.tasks:
            error = None
            try:
                with self._evaluating():
                    results = run_tasks(self.lm, [spec], self.manager, limit=self.cfg.limit,
                                        num_fewshot=self.cfg.num_fewshot, bootstrap_iters=0, environment=False)
                metrics.update(flat_metrics(results) if results is not None else {})
            except Exception as e:  # a task's failure is reported, and training goes on
                error = f"{type(e).__name__}: {e}"
                log.error("evaluation task %s failed; training goes on:\n%s", spec, traceback.format_exc())
            if _failed_anywhere(error is not None):
                failures.append({"task": spec, "error": error or "failed on another rank (see its log)"})
        return metrics, failures

    @contextlib.contextmanager
    def _evaluating(self):
        """The model in eval mode, compiled code run eagerly, and every random number generator as it was."""
        cuda = [self.device] if self.device.type == "cuda" else []
        states = random.getstate(), np.random.get_state()
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=cuda), torch.compiler.set_stance("force_eager"), torch.no_grad():
                yield
        finally:
            self.model.train()
            random.setstate(states[0])
            np.random.set_state(states[1])


def _failed_anywhere(failed: bool) -> bool:
    """Whether a task failed on any rank, agreed by all of them (a host collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failed
    flag = torch.tensor([int(failed)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag)


def evaluate_downstream(evaluation: DownstreamEvaluation, step: int, writer) -> None:
    """Run the tasks and log them: the metrics (with the seconds they took, `eval/seconds`) as a record of `step`,
    each failure as an `eval_failed` event; `writer`: rank 0's metrics writer, None on the others."""
    start = time.perf_counter()
    metrics, failures = evaluation.run()
    if writer is None:
        return
    for failure in failures:
        writer.write_event({"event": "eval_failed", "step": step, **failure})
    writer.write_downstream({"step": step, **metrics, "eval/seconds": time.perf_counter() - start})
