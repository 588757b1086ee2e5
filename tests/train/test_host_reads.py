"""Host reads of tensors per training step: none on the steps that do not log.

On a GPU each read (`item`, `tolist`, `cpu`, `numpy`, `bool`, `int`, `float` of a tensor) waits for the queued
kernels, so the host stops running ahead of the device. The loop reads only on logging steps. The data loader
works on host memory by design and is not counted, nor are torch's reads of its optimizers' step counters, which
live on the host unless the optimizer is fused or capturable; everything else the step does is counted.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch

from maester.config import load_config
from maester.train.trainer import Trainer
from tests.helpers import tiny_overrides, write_corpus

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
STEPS, INTERVAL = 10, 5


def count_reads(trainer: Trainer, monkeypatch) -> dict[int, list[str]]:
    reads: dict[int, list[str]] = collections.defaultdict(list)

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            frames = [f for f in stack if "/maester/" in f.filename]
            optimizer_step_count = "/torch/optim/" in stack[-1].filename and self.dim() == 0
            if frames and "/maester/data/" not in frames[-1].filename and not optimizer_step_count:
                reads[trainer.step].append(f"{name} at {frames[-1].filename.split('/maester/')[-1]}:"
                                           f"{frames[-1].lineno}")
            return original(self, *args, **kwargs)
        return counted

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name))
    return reads


@pytest.mark.parametrize("mode", ["pretrain", "sft"])
def test_no_host_reads_on_steps_that_do_not_log(tmp_path, monkeypatch, mode):
    extra = dict(training__steps=STEPS, logging__interval=INTERVAL, checkpoint__interval=0,
                 checkpoint__save_final="false", training__global_batch_size=4, training__micro_batch_size=2)
    if mode == "sft":
        import json

        from tests.data.test_sft import write_conversations

        data = tmp_path / "chats.jsonl"
        write_conversations(data, 40)
        extra.update(data__mode="sft", data__seq_len=128, data__sources=json.dumps([{"path": str(data)}]))
    else:
        data = write_corpus(tmp_path / "corpus.parquet")
    cfg = load_config(None, tiny_overrides(data, tmp_path / "jobs", **extra), environ={})
    trainer = Trainer(cfg, cfg.job_dir)
    reads = count_reads(trainer, monkeypatch)
    trainer.train()
    logging_steps = {1, INTERVAL, STEPS}
    assert {step: r for step, r in reads.items() if step not in logging_steps and step > 0} == {}
    assert reads[INTERVAL], "the counter saw no read on a logging step: it is not counting"
