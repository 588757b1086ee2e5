"""Non-finite losses (a NaN injected into one step's loss): `stop` ends the run at once with the step and saves
nothing after it; `skip` drops exactly that update, on one process and on two FSDP ranks where only one saw it."""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path

import pytest
import torch

from maester.config import load_config
from maester.train.metrics import read_metrics
from maester.train.nonfinite import NonFiniteError
from maester.train.preemption import COMPLETED_FILE, REQUEUE_FILE
from maester.train.trainer import Trainer
from tests import forkserver
from tests.helpers import DEMO_CONFIG, clean_env, run_maester, tiny_overrides, torchrun
from tests.test_progress import assert_no_bar


def full_state(checkpoint: Path, tmp_path: Path) -> dict:
    """Model and optimizer state of a DCP checkpoint, as one flat dict of tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    flat: dict = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and any(".optimizer." in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_stop_ends_the_run_at_the_bad_step_and_saves_nothing_after_it(corpus, tmp_path):
    args = tiny_overrides(corpus, tmp_path / "jobs", "stop", checkpoint__interval=2, logging__interval=4)
    r = run_maester(["train", str(DEMO_CONFIG), *args], tmp_path, env=clean_env(_MAESTER_FAULT="nan_loss:3"))
    assert r.returncode == 4, r.stderr[-3000:]
    assert "non-finite loss or gradient norm at step 3" in r.stderr
    job = tmp_path / "jobs" / "stop"
    assert "checkpoints/step-2" in r.stderr.splitlines()[-2]  # the message names the checkpoint to resume from
    assert sorted(p.name for p in (job / "checkpoints").glob("step-*")) == ["step-2"]  # step 4's save refused
    assert not (job / COMPLETED_FILE).exists() and not (job / REQUEUE_FILE).exists()
    assert_no_bar(r.stderr)  # stderr is a pipe: no progress bar


def train_here(corpus, tmp_path, monkeypatch, fault: str, name: str, **extra) -> Path:
    """Train a tiny job in this process with `_MAESTER_FAULT=fault`; returns its job directory."""
    monkeypatch.setenv("_MAESTER_FAULT", fault)
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", name, **extra), environ={})
    Trainer(cfg, cfg.job_dir).train()
    return cfg.job_dir


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_skip_drops_exactly_the_bad_update(corpus, tmp_path, monkeypatch, optimizer):
    """AdamW skips on the device (fused kernel, found_inf); Muon through the host-read flag."""
    job = train_here(corpus, tmp_path, monkeypatch, "nan_loss:3", optimizer, checkpoint__interval=1,
                     checkpoint__keep_last=8, training__steps=5, training__nonfinite="skip", optimizer__name=optimizer)
    records = read_metrics(job / "metrics.jsonl")
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1]
    assert records[2]["loss"] is None and all(r["loss"] is not None for r in records[3:])
    ckpt = job / "checkpoints"
    assert_same_state(full_state(ckpt / "step-2", tmp_path), full_state(ckpt / "step-3", tmp_path))
    changed = full_state(ckpt / "step-4", tmp_path)
    assert not torch.equal(changed[".model.output.weight"], full_state(ckpt / "step-3", tmp_path)[".model.output.weight"])


def test_skip_on_two_fsdp_ranks_when_only_one_saw_the_nan(corpus, tmp_path):
    args = tiny_overrides(corpus, tmp_path / "jobs", "fsdp", checkpoint__interval=1, checkpoint__keep_last=8,
                          training__steps=4, training__nonfinite="skip")
    r = torchrun(2, ["train", str(DEMO_CONFIG), *args], tmp_path, env=clean_env(_MAESTER_FAULT="nan_loss:3@1"))
    assert r.returncode == 0, r.stderr[-3000:]
    job = tmp_path / "jobs" / "fsdp"
    assert [r["skipped_steps"] for r in read_metrics(job / "metrics.jsonl")] == [0, 0, 1, 1]
    ckpt = job / "checkpoints"
    assert_same_state(full_state(ckpt / "step-2", tmp_path), full_state(ckpt / "step-3", tmp_path))


def test_too_many_skips_stop_the_run(corpus, tmp_path, monkeypatch):
    message = ("2 steps had a non-finite loss or gradient norm and were skipped, the first at step 2: more than "
               "training.max_skipped_steps = 1")
    with pytest.raises(NonFiniteError, match=re.escape(message)):
        train_here(corpus, tmp_path, monkeypatch, "nan_loss:2,nan_loss:3", "many", training__nonfinite="skip",
                   training__max_skipped_steps=1, checkpoint__interval=0, logging__interval=1)


def test_detect_anomaly_names_the_backward_op(corpus, tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="returned nan values in its 0th output"):
        train_here(corpus, tmp_path, monkeypatch, "nan_loss:2", "anomaly", training__detect_anomaly="true",
                   training__steps=3)


def test_gc_is_off_in_the_loop_and_runs_on_schedule(corpus, tmp_path):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "gc", training__gc_interval=3,
                                           training__steps=7), environ={})
    trainer = Trainer(cfg, cfg.job_dir)
    collections: list[tuple[int, bool]] = []  # (step, automatic GC enabled) at each collection

    def on_gc(phase, info):
        if phase == "start":
            collections.append((trainer.step, gc.isenabled()))

    gc.callbacks.append(on_gc)
    try:
        trainer.train()
    finally:
        gc.callbacks.remove(on_gc)
    assert gc.isenabled()  # given back after training
    in_loop = [step for step, _ in collections if 1 <= step < 7]
    assert set(in_loop) == {3, 6}, collections  # no collection the loop did not ask for
    assert not any(enabled for step, enabled in collections if 1 <= step < 7)


def test_a_hung_rank_ends_the_job_within_the_train_timeout(corpus, tmp_path):
    args = tiny_overrides(corpus, tmp_path / "jobs", "hang", training__steps=6, checkpoint__interval=0,
                          checkpoint__save_final="false", training__train_timeout_seconds=5,
                          logging__per_rank_files="true")
    r = torchrun(2, ["train", str(DEMO_CONFIG), *args], tmp_path, timeout=240,
                 env=clean_env(_MAESTER_FAULT="hang:2@1", _MAESTER_HANG_SECONDS="120"))
    assert r.returncode != 0
    assert "maester train: error:" in r.stderr and "a collective failed or timed out" in r.stderr
    logs = tmp_path / "jobs" / "hang" / "logs"
    assert "model llama/tiny" in (logs / "rank-1.log").read_text()  # every rank keeps its whole log
    assert "model llama/tiny" in (logs / "rank-0.log").read_text()


@pytest.mark.parametrize("loss, norm, overflow, bad", [
    (2.0, 1.5, None, False), (2.0, 0.0, None, True), (float("nan"), 1.0, None, True), (2.0, float("inf"), None, True),
    (2.0, float("inf"), 1, False),  # an fp16 overflow: the loss scaler's
])
def test_the_steps_after_a_load_stop_at_a_dead_or_non_finite_model(loss, norm, overflow, bad, tmp_path):
    from maester.config import CheckpointConfig
    from maester.train.checkpoint import Checkpointer
    from maester.train.nonfinite import AfterLoadWatch

    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    checkpointer.hold_retention = True
    loaded, since = checkpointer.dir / "step-30", checkpointer.dir / "step-35"
    for step, path in ((30, loaded), (35, since)):
        path.mkdir(parents=True)
        (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    watch = AfterLoadWatch(loaded, 30, torch.device("cpu"))
    watch.observe(31, torch.tensor(loss), torch.tensor(norm), None if overflow is None else torch.tensor(overflow))
    if bad:
        with pytest.raises(ValueError, match=f"step 31, 1 step\\(s\\) after loading the checkpoint {loaded}.*"
                                             f"the checkpoints saved since, step-35.damaged, are set aside"):
            watch.check(31, checkpointer)
        assert not since.exists() and (checkpointer.dir / "step-35.damaged").is_dir()
    else:
        assert watch.check(31, checkpointer) is False and checkpointer.hold_retention
        watch.observe(40, torch.tensor(2.0), torch.tensor(1.0), None)
        assert watch.check(40, checkpointer) is True and not checkpointer.hold_retention  # 10 steps watched


def _watch_one_rank(rank: int, store: str, found) -> None:
    import os

    import torch.distributed as dist

    from maester.train.nonfinite import AfterLoadWatch

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        watch = AfterLoadWatch(Path("step-30"), 30, torch.device("cpu"), group=dist.group.WORLD)
        # rank 1's share of the loss alone is NaN; the gradient norm (global) is finite
        watch.observe(31, torch.tensor(float("nan") if rank else 2.0), torch.tensor(1.0), None)
        found.put((rank, bool(watch.bad)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown with gloo's threads


def test_the_watch_after_a_load_raises_on_every_rank_when_one_loss_share_is_bad(tmp_path):
    """A rank that raised alone would wait alone in the collective that sets the checkpoints aside."""
    import torch.multiprocessing as mp

    ctx = forkserver.context()
    found = ctx.SimpleQueue()
    mp.start_processes(_watch_one_rank, args=(str(tmp_path / "store"), found), nprocs=2, join=True,
                       start_method="forkserver")
    assert sorted(found.get() for _ in range(2)) == [(0, True), (1, True)]
