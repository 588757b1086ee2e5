"""The training loop end to end: learning, batch-split invariance, exact resume after a kill, atomic saves."""

from __future__ import annotations

import json
import math
import os
import signal

import pyarrow.parquet as pq
import pytest
import torch

from maester.config import load_config
from maester.train.checkpoint import resolve_checkpoint
from maester.train.checkpoint_reader import load_model_weights
from maester.train.metrics import read_metrics
from maester.train.trainer import Trainer
from tests.helpers import DEMO_CONFIG, clean_env, run_maester, tiny_overrides


def make_trainer(corpus, tmp_path, name="run", **extra) -> Trainer:
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", name, **extra), environ={})
    return Trainer(cfg, cfg.job_dir)


def losses(job_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(job_dir / "metrics.jsonl")}


def test_loss_goes_down(corpus, tmp_path):
    trainer = make_trainer(corpus, tmp_path, training__steps=40, checkpoint__interval=0,
                           checkpoint__save_final="false")
    result = trainer.train()
    curve = losses(trainer.job_dir)
    assert result.step == 40 and result.checkpoint is None
    assert curve[1] > 5.0  # ~ln(320) at initialisation
    assert curve[40] < curve[1] - 2.0, curve


@pytest.mark.parametrize("micro", [2, 4])
def test_loss_does_not_depend_on_micro_batch_split(corpus, tmp_path, micro):
    """Loss is normalised by the label tokens of the whole step, so 1, 2 or 4 micro-batches train identically: each
    step's loss, and the gradient the optimizer steps on, equal up to the order of the sums.

    The parameters after the steps are not compared elementwise: AdamW divides by sqrt(v) + eps, which turns a
    summation-order difference of 1e-10 in a gradient of 1e-7 (1000x below the tensor's median) into a weight
    difference of 4e-6, 0.15% of a step's lr; that passed or failed a tolerance by the machine's kernels."""

    def trainer_with_grads(name, micro_batch):
        trainer = make_trainer(corpus, tmp_path, name, training__global_batch_size=8,
                               training__micro_batch_size=micro_batch, training__steps=3,
                               checkpoint__save_final="false")
        grads = []  # per step: each parameter's gradient as optimizer.step() receives it (clipped)

        def keep(optimizer, args, kwargs):
            grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        trainer.optimizer.register_step_pre_hook(keep)
        return trainer, grads

    whole, whole_grads = trainer_with_grads("whole", 8)
    split, split_grads = trainer_with_grads("split", micro)
    assert split.loader.batch.accumulation_steps == 8 // micro and whole.loader.batch.accumulation_steps == 1
    whole.train()
    split.train()
    a, b = read_metrics(whole.job_dir / "metrics.jsonl"), read_metrics(split.job_dir / "metrics.jsonl")
    for ra, rb in zip(a, b, strict=True):  # the norm is taken before clipping: it sees a gradient's scale
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5, abs=1e-6)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    assert len(whole_grads) == len(split_grads) == 3
    for step, (ga, gb) in enumerate(zip(whole_grads, split_grads), start=1):
        for name, g in ga.items():  # a tolerance on the tensor's scale: a wrong normalisation is off by a factor
            scale = g.abs().max().item()
            torch.testing.assert_close(gb[name], g, rtol=0, atol=1e-4 * scale, msg=f"step {step}: {name}")


def test_tokens_as_batch_unit_equals_sequences(corpus, tmp_path):
    cfg_tok = load_config(None, tiny_overrides(corpus, tmp_path, "t", training__batch_unit="tokens",
                                               training__global_batch_size=128, training__micro_batch_size=64),
                          environ={})
    assert cfg_tok.sequences(cfg_tok.training.global_batch_size) == 4
    assert cfg_tok.sequences(cfg_tok.training.micro_batch_size) == 2


def test_exact_resume_after_kill(corpus, tmp_path):
    """2N uninterrupted steps == N steps, a SIGKILL, then a resume to 2N: bit-identical losses N+1..2N."""
    n = 4
    straight = run_maester(["train", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", "straight")], tmp_path)
    assert straight.returncode == 0, straight.stderr

    killed = run_maester(["train", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", "resumed")], tmp_path,
                         env=clean_env(_MAESTER_FAULT=f"after_step:{n + 2}"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    job = tmp_path / "jobs" / "resumed"
    assert os.readlink(job / "checkpoints" / "latest") == f"step-{n}"
    assert max(losses(job)) == n + 2  # the killed run got past the checkpoint before dying

    resumed = run_maester(["train", str(job)], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and f"step-{n}" in resumed.stderr
    a, b = losses(tmp_path / "jobs" / "straight"), losses(job)
    assert sorted(a) == sorted(b) == list(range(1, 2 * n + 1))
    for step in range(n + 1, 2 * n + 1):
        assert a[step] == b[step], (step, a[step], b[step])  # bitwise: JSON keeps every float bit
    grad_a = {r["step"]: r["grad_norm"] for r in read_metrics(tmp_path / "jobs" / "straight" / "metrics.jsonl")}
    grad_b = {r["step"]: r["grad_norm"] for r in read_metrics(job / "metrics.jsonl")}
    assert all(grad_a[s] == grad_b[s] for s in range(n + 1, 2 * n + 1))


def test_crash_while_saving_keeps_previous_checkpoint(corpus, tmp_path):
    job = tmp_path / "jobs" / "crash"
    crashed = run_maester(["train", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", "crash")], tmp_path,
                          env=clean_env(_MAESTER_FAULT="during_save:8"))
    assert crashed.returncode == -signal.SIGKILL
    ckpts = job / "checkpoints"
    assert os.readlink(ckpts / "latest") == "step-4"
    assert (ckpts / "step-8.tmp" / ".metadata").is_file()  # model and optimizer written, the rest not
    assert not (ckpts / "step-8").exists()

    # The previous checkpoint loads, and the half-written one is never taken for a good one.
    path = resolve_checkpoint(job)
    assert path.name == "step-4"
    with pytest.raises(ValueError, match="incomplete"):
        resolve_checkpoint(ckpts / "step-8.tmp")
    trainer = make_trainer(tmp_path / "data" / "corpus.parquet", tmp_path, "crash")
    assert trainer.step == 4
    result = trainer.train()
    assert result.step == 8 and result.checkpoint.name == "step-8"
    assert not (ckpts / "step-8.tmp").exists()
    assert json.loads((ckpts / "step-8" / "trainer_state.json").read_text())["step"] == 8


def test_retention_keeps_last_k_and_every_kth(corpus, tmp_path):
    trainer = make_trainer(corpus, tmp_path, "keep", training__steps=9, checkpoint__interval=1,
                           checkpoint__keep_last=2, checkpoint__keep_every=4)
    trainer.train()
    names = sorted(p.name for p in (trainer.job_dir / "checkpoints").iterdir())
    assert names == ["latest", "step-4", "step-8", "step-9"]


def test_init_from_loads_weights_only_while_job_has_no_checkpoint(corpus, tmp_path):
    source = make_trainer(corpus, tmp_path, "source", training__steps=4)
    source.train()
    fine = make_trainer(corpus, tmp_path, "fine", training__steps=6, checkpoint__init_from=str(source.job_dir))
    for p, q in zip(source.model.parameters(), fine.model.parameters()):
        assert torch.equal(p, q)
    assert fine.step == 0  # a new run: step, optimizer and data start fresh
    fine.train()
    # Once the job has its own checkpoint, init_from is ignored and the job resumes.
    again = make_trainer(corpus, tmp_path, "fine", training__steps=6, checkpoint__init_from=str(source.job_dir))
    assert again.step == 6
    reference = make_trainer(corpus, tmp_path, "ref", training__steps=2)
    load_model_weights(resolve_checkpoint(again.job_dir), reference.model)
    for p, q in zip(again.model.parameters(), reference.model.parameters()):
        assert torch.equal(p, q)


def test_resume_on_different_data_is_refused(corpus, tmp_path):
    make_trainer(corpus, tmp_path, "d", training__steps=4).train()
    from tests.helpers import write_corpus

    other = write_corpus(tmp_path / "other" / "c.parquet", seed=1)
    with pytest.raises(ValueError, match="different data"):
        make_trainer(other, tmp_path, "d", training__steps=8)


def test_layout_that_does_not_fit_one_process_is_refused(corpus, tmp_path):
    with pytest.raises(ValueError, match="does not divide the 1 process"):
        make_trainer(corpus, tmp_path, "p", parallel__tp=2)


def test_held_out_split_is_evaluated_and_logged(corpus, tmp_path):
    trainer = make_trainer(corpus, tmp_path, training__steps=12, logging__eval_interval=6,
                           data__sources=f'[{{"path":"{corpus}","validation_fraction":0.2}}]',
                           checkpoint__save_final="false", checkpoint__interval=0)
    trainer.train()
    records = {r["step"]: r for r in read_metrics(trainer.job_dir / "metrics.jsonl")}
    assert "loss" in records[6] and "val_loss" in records[6] and "val_loss" not in records[5]
    assert records[12]["val_loss"] < records[6]["val_loss"] < 6.0
    # what evaluate() reports is the mean token loss over the validation batches
    batches = trainer.loader.validation_batches(2)
    with torch.no_grad():
        total = sum(torch.nn.functional.cross_entropy(trainer.model(b.input_ids, b.position_ids).flatten(0, 1),
                                                      b.labels.flatten(), reduction="sum") for b in batches)
    n = sum(b.labels.numel() for b in batches)
    got = trainer.evaluate()
    assert got["val_loss"] == pytest.approx((total / n).item(), rel=1e-5)
    assert got["val_perplexity"] == pytest.approx(math.exp(got["val_loss"]), rel=1e-9)
    assert records[12]["val_perplexity"] == pytest.approx(math.exp(records[12]["val_loss"]), rel=1e-9)


def test_validation_sources_are_evaluated_whole_and_never_trained_on(corpus, tmp_path):
    from maester.data.loader import validation_source_batches
    from tests.helpers import write_corpus

    held = write_corpus(tmp_path / "held" / "other.parquet", n_docs=12, seed=7)
    more = write_corpus(tmp_path / "held" / "more.parquet", n_docs=8, seed=8)
    sources = f'[{{"path":"{held}","name":"other"}},{{"path":"{more}","name":"more"}}]'
    trainer = make_trainer(corpus, tmp_path, training__steps=4, logging__eval_interval=2, data__validation=sources,
                           checkpoint__save_final="false", checkpoint__interval=0)
    trainer.train()
    records = {r["step"]: r for r in read_metrics(trainer.job_dir / "metrics.jsonl")}
    assert sorted(k for k in records[4] if k.startswith("val")) == [
        "val/more/loss", "val/more/perplexity", "val/other/loss", "val/other/perplexity", "val_loss",
        "val_perplexity"]
    assert "val_loss" in records[2] and "val_loss" not in records[3]
    # every window of the source, in order: the first batch starts with the source's first document
    cfg = trainer.cfg
    batches = validation_source_batches(cfg.data.validation[0], cfg.data, trainer.tokenizer, 2)
    first = pq.read_table(held).column("text")[0].as_py()
    assert bytes(batches[0].input_ids[0].tolist()) == first.encode()[:cfg.data.seq_len]
    with torch.no_grad():
        total = sum(torch.nn.functional.cross_entropy(trainer.model(b.input_ids, b.position_ids).flatten(0, 1),
                                                      b.labels.flatten(), reduction="sum") for b in batches)
    n = sum(b.labels.numel() for b in batches)
    assert trainer.evaluate()["val/other/loss"] == pytest.approx((total / n).item(), rel=1e-5)
    with pytest.raises(ValueError, match="logging.eval_interval is 0"):
        make_trainer(corpus, tmp_path, data__validation=sources)


def test_eval_without_a_held_out_split_is_an_error(corpus, tmp_path):
    with pytest.raises(ValueError, match="no data source holds out a validation split"):
        make_trainer(corpus, tmp_path, logging__eval_interval=1)
    tiny_split = f'[{{"path":"{corpus}","validation_fraction":0.001}}]'  # fewer held-out tokens than a window
    trainer = make_trainer(corpus, tmp_path, training__steps=2, logging__eval_interval=1, data__sources=tiny_split,
                           checkpoint__save_final="false", checkpoint__interval=0)
    with pytest.raises(ValueError, match="too few windows"):
        trainer.train()


def test_matmul_precision_is_set_for_the_run(corpus, tmp_path, monkeypatch):
    before = torch.get_float32_matmul_precision()
    try:
        cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "tf32", training__matmul_precision="high"),
                          environ={})
        Trainer(cfg, cfg.job_dir)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_step_seconds_is_the_window_s_wall_time_per_step(corpus, tmp_path):
    import time

    trainer = make_trainer(corpus, tmp_path, training__steps=6, logging__interval=3, checkpoint__interval=0,
                           checkpoint__save_final="false")
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    records = {r["step"]: r for r in read_metrics(trainer.job_dir / "metrics.jsonl")}
    assert sorted(records) == [1, 3, 6]  # windows of 1, 2 and 3 steps
    step_tokens = records[6]["tokens_seen"] / 6
    for r in records.values():  # tokens/s and seconds/step describe the same window
        assert r["step_seconds"] * r["tokens_per_second"] == pytest.approx(step_tokens, rel=1e-9)
    steps = {1: 1, 3: 2, 6: 3}
    assert 0 < sum(r["step_seconds"] * steps[s] for s, r in records.items()) < wall
