"""Run under torchrun (two processes, gloo): the in-loop evaluation of a tiny Llama sharded by tensor and sequence
parallel, as training shards it, next to lm-eval's results for the whole model built on each process from the same
seed. Each rank writes result-<rank>.json into argv[1]: the two sets of metrics and every request's responses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from maester.config import load_config
from maester.data.tokenizers import build_tokenizer
from maester.evaluation.harness import flat_metrics, run_tasks
from maester.evaluation.harness_lm import MaesterLM
from maester.models.build import build_on_meta, materialize, resolve_args
from maester.parallel.dims import ParallelDims, init_distributed
from maester.parallel.precision import resolve_precision
from maester.train.downstream import DownstreamEvaluation
from maester.train.setup import build_training_model

TASKS = ["pydoc_choice", "pydoc_complete"]

rank, world, device = init_distributed("cpu", 120, "fp32")
cfg = load_config(None, ["--model.flavor=tiny", '--model.overrides={"max_seq_len": 64}', "--parallel.tp=2",
                         "--parallel.dp_shard=1", "--data.seq_len=32", "--training.device=cpu",
                         f"--evaluation.tasks={json.dumps(TASKS)}", "--evaluation.limit=5",
                         "--evaluation.batch_size=2"], environ={})
tokenizer = build_tokenizer(cfg.tokenizer)
dims = ParallelDims.from_config(cfg, world)
precision = resolve_precision("fp32", "auto", "cpu", dims.fsdp_enabled)
sharded = build_training_model(cfg, tokenizer.vocab_size, dims, device, precision)
evaluation = DownstreamEvaluation(cfg, sharded, tokenizer, dims, device, precision)
metrics, failures = evaluation.run()
with evaluation._evaluating():
    samples = run_tasks(evaluation.lm, TASKS, evaluation.manager, limit=5, log_samples=True, bootstrap_iters=0,
                        environment=False)
whole = materialize(build_on_meta(cfg.model, resolve_args(cfg.model, tokenizer.vocab_size, cfg.mup), torch.float32),
                    device, cfg.training.seed).eval()
reference = run_tasks(MaesterLM(whole, tokenizer, device=device, batch_size=3), TASKS, evaluation.manager, limit=5,
                      log_samples=True, bootstrap_iters=0, environment=False)
result = {"sharded": sharded.layers["0"].attention.k_proj.weight.to_local().shape[0] * 2 ==
          sharded.layers["0"].attention.k_proj.weight.shape[0], "failures": failures}
if rank == 0:  # lm-eval reports on the first process of a node only
    result.update(metrics=metrics, expected_metrics=flat_metrics(reference), **{
        key: {task: {s["doc_id"]: s["resps"] for s in by_task} for task, by_task in got["samples"].items()}
        for key, got in (("responses", samples), ("expected", reference))})
(Path(sys.argv[1]) / f"result-{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
