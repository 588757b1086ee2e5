"""A damaged newest checkpoint is moved aside and the run resumes from the newest intact one, bit for bit as from
a clean copy of it; with none intact the run stops and lists what it found. `latest` is only a convenience: a
lost link resumes from the step-N directories, a copied-in directory is refused at start."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from maester.train.metrics_file import read_events

from tests.helpers import DEMO_CONFIG, run_maester, tiny_overrides, write_corpus


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    corpus = write_corpus(root / "corpus.parquet")
    args = tiny_overrides(corpus, root / "jobs", "x", training__steps=4, checkpoint__interval=2,
                          logging__interval=1)
    first = run_maester(["train", str(DEMO_CONFIG), *args], cwd=root)
    assert first.returncode == 0, first.stderr[-2000:]
    return root / "jobs" / "x"


@pytest.fixture(scope="module")
def from_step_2(trained, tmp_path_factory):
    """Losses of steps 3-6 resumed from an intact step-2 (step-4 removed cleanly, as retention would)."""
    job = copy_job(trained, tmp_path_factory.mktemp("clean"))
    shutil.rmtree(job / "checkpoints" / "step-4")
    (job / "checkpoints" / "latest").unlink()
    resumed = run_maester(["train", str(job), "--training.steps=6"], cwd=job.parent)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return losses_after(job, 2)


def copy_job(trained, where):
    job = where / "x"
    shutil.copytree(trained, job, symlinks=True)
    return job


def losses_after(job, step: int) -> dict[int, float]:
    lines = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r and r["step"] > step}


def events(job) -> list[dict]:
    return [r for r in read_events(job) if r["event"] == "checkpoint_damaged"]


def truncate(step):
    shard = next(step.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(1000)
    return shard


def flip_a_byte(step):
    shard = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def truncate_file(name: str):
    def damage(step):
        with open(step / name, "r+b") as f:
            f.truncate(100)
    return damage


DAMAGE = {
    "garbage trainer_state.json": lambda step: (step / "trainer_state.json").write_text("garbage") and None,
    "missing shard": lambda step: next(step.glob("*.distcp")).unlink(),
    "truncated shard": truncate,
    "truncated .metadata": truncate_file(".metadata"),
    "truncated RNG state": truncate_file("rng/rank0.pt"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_newest_is_moved_aside_and_the_run_resumes_from_the_one_before(trained, from_step_2, tmp_path,
                                                                                damage):
    job = copy_job(trained, tmp_path)
    step4 = job / "checkpoints" / "step-4"
    DAMAGE[damage](step4)
    out = run_maester(["train", str(job), "--training.steps=6"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CHECKPOINT DAMAGED" in out.stderr and "moved aside to step-4.damaged" in out.stderr
    assert (job / "checkpoints" / "step-4.damaged").is_dir()  # kept, never deleted
    assert losses_after(job, 2) == from_step_2
    (event,) = events(job)
    assert event["event"] == "checkpoint_damaged" and event["checkpoint"] == "step-4" and event["step"] == 2
    assert event["problems"]


def test_same_size_corruption_is_found_by_full_verification(trained, from_step_2, tmp_path):
    job = copy_job(trained, tmp_path)
    shard = flip_a_byte(job / "checkpoints" / "step-4")
    out = run_maester(["train", str(job), "--training.steps=6", "--checkpoint.verify=full"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{shard.name}: XXH3-128" in out.stderr
    assert losses_after(job, 2) == from_step_2


def test_none_intact_stops_and_lists_what_was_found(trained, tmp_path):
    job = copy_job(trained, tmp_path)
    for step in ("step-2", "step-4"):
        truncate(job / "checkpoints" / step)
    for attempt in range(2):  # and a second attempt does not start from step 0 either
        out = run_maester(["train", str(job), "--training.steps=6"], cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-2000:]
        assert "Traceback" not in out.stderr
        assert "no intact checkpoint" in out.stderr and "step-2.damaged, step-4.damaged" in out.stderr
    assert not (job / "checkpoints" / "step-6").exists()


def test_lost_latest_link_resumes_from_the_newest_step(trained, tmp_path):
    job = copy_job(trained, tmp_path)
    (job / "checkpoints" / "latest").unlink()  # rsync -r and object stores drop links
    before = (job / "checkpoints" / "step-4" / "manifest.json").read_bytes()
    out = run_maester(["train", str(job), "--training.steps=6"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed from" in out.stderr and "step-4 at step 4" in out.stderr
    assert (job / "checkpoints" / "step-4" / "manifest.json").read_bytes() == before  # not overwritten
    assert (job / "checkpoints" / "latest").resolve().name == "step-6"


def test_latest_as_a_directory_is_refused_at_start(trained, tmp_path):
    job = copy_job(trained, tmp_path)
    latest = job / "checkpoints" / "latest"
    latest.unlink()
    shutil.copytree(job / "checkpoints" / "step-4", latest)  # cp -L
    out = run_maester(["train", str(job), "--training.steps=6"], cwd=tmp_path)
    assert out.returncode == 2 and "is a directory, not a link" in out.stderr, out.stderr[-2000:]
    assert "step 5" not in out.stderr


def test_unwritable_checkpoint_directory_is_found_at_start(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.parquet")
    (tmp_path / "jobs" / "y").mkdir(parents=True)
    checkpoints = tmp_path / "jobs" / "y" / "checkpoints"
    if os.geteuid() == 0:  # root writes through permission bits; /sys refuses it
        checkpoints.symlink_to("/sys")
    else:
        checkpoints.mkdir(mode=0o500)
    args = tiny_overrides(corpus, tmp_path / "jobs", "y", training__steps=4, checkpoint__interval=2)
    out = run_maester(["train", str(DEMO_CONFIG), *args], cwd=tmp_path)
    assert out.returncode == 2 and "cannot be written" in out.stderr, out.stderr[-2000:]
    assert "step 1 " not in out.stderr  # before any step is computed


def test_checkpoint_verify_command(trained, tmp_path):
    job = copy_job(trained, tmp_path)
    ok = run_maester(["checkpoint", "verify", str(job)], cwd=tmp_path)
    assert ok.returncode == 0 and "2 intact, 0 damaged" in ok.stdout, ok.stdout + ok.stderr
    shard = flip_a_byte(job / "checkpoints" / "step-2")
    sized = run_maester(["checkpoint", "verify", str(job), "--level", "size"], cwd=tmp_path)
    assert sized.returncode == 0  # a flipped byte keeps the size
    full = run_maester(["checkpoint", "verify", str(job / "checkpoints" / "step-2")], cwd=tmp_path)
    assert full.returncode == 1 and f"{shard}: XXH3-128" in full.stdout, full.stdout + full.stderr
