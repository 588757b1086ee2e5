"""Every rank resumes from the checkpoint rank 0 finds, and fails with rank 0's error."""

from __future__ import annotations

import json
import os
import pickle

from tests.helpers import REPO, torchrun


def run(tmp_path) -> dict[int, dict]:
    proc = torchrun(2, [str(tmp_path)], tmp_path, timeout=120,
                    script=REPO / "tests" / "distributed" / "rank_zero_latest.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {rank: json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)}


def view(tmp_path, rank: int, steps: list[int], latest: int | None):
    """Checkpoints from before manifests, each with an empty DCP metadata (an empty file is a damaged one)."""
    from torch.distributed.checkpoint.metadata import Metadata

    ckpt = tmp_path / f"view-{rank}" / "checkpoints"
    for step in steps:
        (ckpt / f"step-{step}").mkdir(parents=True)
        (ckpt / f"step-{step}" / ".metadata").write_bytes(pickle.dumps(Metadata({})))
        (ckpt / f"step-{step}" / "trainer_state.json").write_text(json.dumps({"step": step}))
    if latest is not None:
        os.symlink(f"step-{latest}", ckpt / "latest")


def test_ranks_take_rank_zero_latest(tmp_path):
    view(tmp_path, 0, [2, 4], latest=4)
    view(tmp_path, 1, [2], latest=2)  # a stale view of the same directory
    out = run(tmp_path)
    assert out[0]["latest"].endswith("view-0/checkpoints/step-4")
    # rank 0's choice, step-4, which rank 1's own stale view does not list (each rank reads it in its job directory)
    assert out[1]["latest"].endswith("view-1/checkpoints/step-4")


def test_rank_zero_error_reaches_every_rank(tmp_path):
    view(tmp_path, 0, [2], latest=None)
    (tmp_path / "view-0" / "checkpoints" / "latest").mkdir()  # a copy made with cp -L
    view(tmp_path, 1, [2], latest=2)
    out = run(tmp_path)
    assert "is a directory, not a link" in out[0]["error"] and out[1]["error"] == out[0]["error"]
