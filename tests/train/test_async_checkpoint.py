"""Checkpoints written in the background (`checkpoint.async_mode`): a background save holds the state of its step
however training changes it afterwards, and writes the same files as a synchronous save; a write that fails for
real (a file size limit) is reported, leaves `latest` alone and is retried at the next interval; a SIGKILL during
a background write leaves the previous checkpoint as `latest` and the resumed run is bit-identical; `pinned` is
refused without CUDA, and on a GPU reuses its page-locked buffers."""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from maester.cli import main
from maester.config import CheckpointConfig, ModelConfig, OptimizerConfig, load_config
from maester.models.build import build_model
from maester.train.checkpoint import Checkpointer
from maester.train.checkpoint_async import resolve_async_mode
from maester.train.checkpoint_files import verify_checkpoint
from maester.train.metrics_file import read_events, read_metrics
from maester.train.optim import build_optimizer
from maester.train.trainer import Trainer
from tests.helpers import DEMO_CONFIG, clean_env, run_maester, tiny_overrides, write_corpus

CPU = torch.device("cpu")
RUN = dict(training__steps=6, checkpoint__interval=2, checkpoint__keep_last=3)


def model_and_optimizer(device=CPU):
    model = build_model(ModelConfig(flavor="tiny"), 269, device, 0)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2), device)
    step_randomly(model, optimizer)
    return model, optimizer


def step_randomly(model, optimizer):
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer moment, copied, by name."""
    names = {p: n for n, p in model.named_parameters()}
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        out.update({f"{names[p]}.{k}": v.clone() for k, v in state.items() if torch.is_tensor(v)})
    return out


def test_async_mode_resolves_by_device_and_pinned_needs_cuda():
    assert resolve_async_mode("auto", "cpu") == "off" and resolve_async_mode("auto", "cuda") == "async"
    assert resolve_async_mode("async", "cpu") == "async" and resolve_async_mode("pinned", "cuda") == "pinned"
    with pytest.raises(ValueError, match=r"async_mode = 'pinned' .* needs CUDA; this run trains on cpu: use 'async'"):
        resolve_async_mode("pinned", "cpu")


def test_pinned_is_refused_on_a_cpu_run(tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path / "corpus.parquet", tmp_path / "jobs", "pinned",
                                           checkpoint__async_mode="pinned"), environ={})
    with pytest.raises(ValueError, match="needs CUDA; this run trains on cpu"):
        Trainer(cfg, cfg.job_dir)
    assert not (cfg.job_dir / "checkpoints").exists() or not any((cfg.job_dir / "checkpoints").iterdir())


def test_a_background_save_holds_its_step_and_writes_what_a_synchronous_save_writes(tmp_path):
    model, optimizer = model_and_optimizer()
    expected = snapshot(model, optimizer)
    background = Checkpointer(tmp_path / "bg", CheckpointConfig(), async_mode="async")
    path = background.save(1, model, optimizer, {"tokens_seen": 1}, "{}", background=True)
    step_randomly(model, optimizer)  # training goes on while the thread writes
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3)
    background.close()
    (result,) = background.finished
    assert result.error is None and result.background and result.write_seconds > 0
    assert os.readlink(tmp_path / "bg" / "checkpoints" / "latest") == "step-1"
    assert verify_checkpoint(path, "full") == []

    loaded_model, loaded_optimizer = model_and_optimizer()
    Checkpointer(tmp_path / "bg", CheckpointConfig()).load(path, loaded_model, loaded_optimizer, "transfer")
    got = snapshot(loaded_model, loaded_optimizer)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # The next save refills the same host buffers (the write of this one has ended: a save waits for it first).
    state = {"model": dict(model.state_dict())}
    first, second = background._stage(state), background._stage(state)
    assert [t.data_ptr() for t in first["model"].values()] == [t.data_ptr() for t in second["model"].values()]

    # The same state saved while the loop waits: the same bytes in every data file.
    synchronous = Checkpointer(tmp_path / "sync", CheckpointConfig())
    sync_path = synchronous.save(1, loaded_model, loaded_optimizer, {"tokens_seen": 1}, "{}")
    assert not synchronous.finished[0].background
    data = sorted(p.name for p in path.glob("*.distcp"))
    assert data and data == sorted(p.name for p in sync_path.glob("*.distcp"))
    assert all((path / n).read_bytes() == (sync_path / n).read_bytes() for n in data)


def events(job, kind: str) -> list[dict]:
    return [r for r in read_events(job) if r["event"] == kind]


def losses(job) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(job / "metrics.jsonl")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The corpus and the losses of the run with synchronous saves, trained straight through in this process."""
    root = tmp_path_factory.mktemp("async-reference")
    corpus = write_corpus(root / "corpus.parquet")
    cfg = load_config(None, tiny_overrides(corpus, root / "jobs", "sync", **RUN), environ={})
    Trainer(cfg, cfg.job_dir).train()
    return corpus, losses(cfg.job_dir)


def test_killed_during_a_background_write_resumes_bit_identical(reference, tmp_path, capsys):
    corpus, expected = reference
    args = tiny_overrides(corpus, tmp_path / "jobs", "killed", checkpoint__async_mode="async", **RUN)
    job = tmp_path / "jobs" / "killed"
    killed = run_maester(["train", str(DEMO_CONFIG), *args], tmp_path, env=clean_env(_MAESTER_FAULT="during_save:4"))
    assert killed.returncode == -9, killed.stderr[-3000:]
    checkpoints = job / "checkpoints"
    assert os.readlink(checkpoints / "latest") == "step-2"
    assert (checkpoints / "step-4.tmp").is_dir() and not (checkpoints / "step-4").exists()
    assert "step-2 written in the background" in killed.stderr  # step 2's write had ended: the kill hit step 4's

    main(["train", str(job)])  # the resume, in this process
    assert "resumed from" in (log := (job / "logs" / "train.log").read_text()) and "step-2 at step 2" in log
    assert losses(job) == expected
    saves = events(job, "checkpoint")
    assert [(r["step"], r["background"]) for r in saves] == [(2, True), (4, True), (6, False)]
    assert all(r["checkpoint_blocked_seconds"] > 0 and r["checkpoint_write_seconds"] > 0 for r in saves)

    capsys.readouterr()
    main(["report", str(job)])
    out = capsys.readouterr().out
    assert "checkpoint saves  3 written (2 in the background)" in out
    assert "save times        loop blocked " in out and "; write " in out


@contextmanager
def file_size_limit(limit: int):
    """Writes of this process beyond `limit` bytes fail with EFBIG (Python ignores SIGXFSZ), until the block ends
    or the limit is lifted."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_failed_background_write_is_reported_and_retried_at_the_next_interval(reference, tmp_path, monkeypatch):
    """A file size limit makes the background write of step 2 fail (EFBIG, for real); while the run stands at
    step 3, the limit is lifted, and the save of step 4 succeeds."""
    corpus, expected = reference
    go_on = tmp_path / "go-on"
    monkeypatch.setenv("_MAESTER_FAULT", "hang:3")
    monkeypatch.setenv("_MAESTER_HANG_UNTIL", str(go_on))
    monkeypatch.setenv("_MAESTER_HANG_SECONDS", "120")
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "efbig", checkpoint__async_mode="async", **RUN),
                      environ={})
    job, seen = cfg.job_dir, []

    def lift_the_limit_after_the_failure():
        deadline = time.monotonic() + 120
        log = job / "logs" / "train.log"
        while time.monotonic() < deadline and not (log.is_file() and "CHECKPOINT NOT WRITTEN" in log.read_text()):
            time.sleep(0.02)
        seen.append((job / "checkpoints" / "latest").exists())
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        go_on.touch()

    watcher = threading.Thread(target=lift_the_limit_after_the_failure)
    with file_size_limit(1 << 20):
        watcher.start()
        try:
            Trainer(cfg, job).train()
        finally:
            go_on.touch()
            watcher.join()
    assert seen == [False]  # no `latest` while step 2's write had failed
    log = (job / "logs" / "train.log").read_text()
    assert "the background save of step-2 failed: checkpoint step-2 could not be written" in log
    failed = events(job, "checkpoint_failed")
    assert [r["step"] for r in failed] == [2] and "File too large" in failed[0]["error"]
    assert [r["step"] for r in events(job, "checkpoint")] == [4, 6]
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["latest", "step-4", "step-6"]
    assert losses(job) == expected  # the failure changed nothing in training


def test_a_run_whose_last_save_failed_does_not_end_quietly(reference, tmp_path, capsys):
    """Every write fails (a file size limit for the whole run), each background failure is reported and training
    goes on; the run ends without its last checkpoint and exits 2 saying so."""
    corpus, _ = reference
    args = tiny_overrides(corpus, tmp_path / "jobs", "full", checkpoint__async_mode="async", training__steps=5,
                          checkpoint__interval=2, checkpoint__save_final="false")
    with file_size_limit(1 << 20), pytest.raises(SystemExit) as exit_:
        main(["train", str(DEMO_CONFIG), *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "ended at step 5 without its last checkpoint: checkpoint step-4 could not be written" in err
    assert "File too large" in err
    job = tmp_path / "jobs" / "full"
    assert [r["step"] for r in read_metrics(job / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in events(job, "checkpoint_failed")] == [2, 4]
    assert not (job / "COMPLETED").exists()
    assert [p.name for p in (job / "checkpoints").iterdir()] == []


@pytest.mark.cuda
def test_pinned_staging_reuses_page_locked_buffers_and_holds_its_step(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cuda = torch.device("cuda")
    model, optimizer = model_and_optimizer(cuda)
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(keep_last=2), async_mode="pinned")
    state = {"model": dict(model.state_dict())}
    first, second = checkpointer._stage(state), checkpointer._stage(state)
    staged = [t for t in first["model"].values()]
    assert all(t.device.type == "cpu" and t.is_pinned() for t in staged)
    assert [t.data_ptr() for t in staged] == [t.data_ptr() for t in second["model"].values()]  # reused

    expected = snapshot(model, optimizer)
    path = checkpointer.save(1, model, optimizer, {"tokens_seen": 1}, "{}", background=True)
    step_randomly(model, optimizer)
    checkpointer.save(2, model, optimizer, {"tokens_seen": 2}, "{}", background=True)  # waits for step 1
    checkpointer.close()
    assert [r.error for r in checkpointer.finished] == [None, None]
    loaded_model, loaded_optimizer = model_and_optimizer(cuda)
    Checkpointer(tmp_path, CheckpointConfig()).load(path, loaded_model, loaded_optimizer, "transfer")
    got = snapshot(loaded_model, loaded_optimizer)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert json.loads((path / "trainer_state.json").read_text())["step"] == 1
