"""A damaged checkpoint is an error that names the checkpoint and the file (exit 2), not a raw traceback."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import DEMO_CONFIG, run_maester, tiny_overrides, write_corpus


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    corpus = write_corpus(root / "corpus.parquet")
    args = tiny_overrides(corpus, root / "jobs", "x", training__steps=4, checkpoint__interval=2)
    first = run_maester(["train", str(DEMO_CONFIG), *args], cwd=root)
    assert first.returncode == 0, first.stderr[-2000:]
    return root / "jobs" / "x"


def damaged_copy(trained, tmp_path):
    job = tmp_path / "x"
    shutil.copytree(trained, job, symlinks=True)
    return job, job / "checkpoints" / "step-4"


def resume(job, tmp_path):
    out = run_maester(["train", str(job), "--training.steps=6"], cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    return out.stderr


def test_garbage_trainer_state_names_the_file(trained, tmp_path):
    job, step = damaged_copy(trained, tmp_path)
    (step / "trainer_state.json").write_text("garbage")
    assert f"{step / 'trainer_state.json'}: not valid JSON" in resume(job, tmp_path)


def test_missing_shard_names_the_file(trained, tmp_path):
    job, step = damaged_copy(trained, tmp_path)
    shard = next(step.glob("*.distcp"))
    shard.unlink()
    err = resume(job, tmp_path)
    assert f"checkpoint {step} cannot be read: {shard}: No such file or directory" in err


def test_truncated_shard_names_the_checkpoint(trained, tmp_path):
    job, step = damaged_copy(trained, tmp_path)
    shard = next(step.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(1000)
    err = resume(job, tmp_path)
    assert f"checkpoint {step} cannot be read" in err and "truncated" in err
