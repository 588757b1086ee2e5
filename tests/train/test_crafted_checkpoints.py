"""A crafted checkpoint cannot run code: DCP's `.metadata` is unpickled through an allowlist of DCP's metadata
classes, and non-tensor values with `weights_only=True`, on every path that opens a checkpoint."""

from __future__ import annotations

import os
import pickle
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from maester.train.checkpoint_reader import dcp_load
from tests.helpers import DEMO_CONFIG, rewrite_manifest, run_maester, tiny_overrides, write_corpus


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("crafted")
    corpus = write_corpus(root / "corpus.parquet")
    args = tiny_overrides(corpus, root / "jobs", "x", training__steps=2, checkpoint__interval=2)
    out = run_maester(["train", str(DEMO_CONFIG), *args], cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    return root / "jobs" / "x" / "checkpoints" / "step-2"


def crafted(checkpoint, tmp_path):
    """A copy of `checkpoint` whose .metadata runs `touch MARKER` when unpickled, its manifest made to match."""
    marker = tmp_path / "PWNED"
    path = tmp_path / "step-2"
    shutil.copytree(checkpoint, path)
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_manifest(path)
    return path, marker


COMMANDS = {
    "generate": lambda ckpt, tmp: ["generate", str(ckpt), "--prompt", "a", "--max-new-tokens", "2"],
    "convert to-hf": lambda ckpt, tmp: ["convert", "to-hf", str(ckpt), str(tmp / "hf")],
    "init_from": lambda ckpt, tmp: ["train", str(DEMO_CONFIG), *tiny_overrides(
        write_corpus(tmp / "c.parquet"), tmp / "jobs", "y", training__steps=2, checkpoint__init_from=str(ckpt))],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_crafted_metadata_runs_nothing(checkpoint, tmp_path, command):
    path, marker = crafted(checkpoint, tmp_path)
    out = run_maester(COMMANDS[command](path, tmp_path), cwd=tmp_path)
    assert not marker.exists()
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{path / '.metadata'}: refused" in out.stderr and "Traceback" not in out.stderr


def test_resume_from_crafted_metadata_runs_nothing(checkpoint, tmp_path):
    path, marker = crafted(checkpoint, tmp_path)
    job = checkpoint.parent.parent
    copy = tmp_path / "x"
    shutil.copytree(job, copy, symlinks=True)
    shutil.copy(path / ".metadata", copy / "checkpoints" / "step-2" / ".metadata")
    out = run_maester(["train", str(copy), "--training.steps=4", "--checkpoint.verify=full"], cwd=tmp_path)
    assert not marker.exists()
    assert out.returncode == 2 and "no intact checkpoint" in out.stderr, out.stderr[-2000:]


def test_crafted_value_runs_nothing(tmp_path):
    marker = tmp_path / "PWNED"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(2), "hyper": Payload(marker)}, checkpoint_id=tmp_path / "ckpt")
    state = {"w": torch.ones(2), "hyper": None}
    with pytest.raises(ValueError, match="the value of hyper is refused"):
        dcp_load(state, tmp_path / "ckpt")
    assert not marker.exists()


def test_plain_values_still_load(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(3.0), "hyper": {"lr": 0.1, "betas": (0.9, 0.95), "name": "decay"}},
                 checkpoint_id=tmp_path / "ckpt")
    state = {"w": torch.zeros(3), "hyper": {"lr": None, "betas": None, "name": None}}
    dcp_load(state, tmp_path / "ckpt")
    assert state["hyper"] == {"lr": 0.1, "betas": (0.9, 0.95), "name": "decay"}
    assert torch.equal(state["w"], torch.arange(3.0))
