"""A save that runs out of space is a clear error: nothing of it is kept, `latest` and the previous checkpoint are
unchanged, and the run resumes from there once there is room."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import uuid

import pytest

from maester.train.checkpoint_files import verify_checkpoint
from tests.helpers import DEMO_CONFIG, clean_env, run_maester, tiny_overrides, write_corpus


def small_tmpfs(where, size: str) -> bool:
    """Mount a tmpfs of `size` at `where` (root in a container that allows it); False where it cannot."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", f"maester-{uuid.uuid4().hex[:6]}",
                           str(where)], capture_output=True)
    return done.returncode == 0


def limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # Python ignores SIGXFSZ: writes fail EFBIG


@pytest.mark.parametrize("how", ["full tmpfs", "file size limit"])
def test_full_disk_at_save_keeps_the_previous_checkpoint(tmp_path, how):
    corpus = write_corpus(tmp_path / "corpus.parquet")
    job = tmp_path / "jobs" / "x"
    args = tiny_overrides(corpus, tmp_path / "jobs", "x", training__steps=2, checkpoint__interval=2)
    mount = tmp_path / "small"
    if how == "full tmpfs":
        if not small_tmpfs(mount, "3m"):  # room for one checkpoint of the tiny model (1.9 MB), not two
            pytest.skip("cannot mount a tmpfs here (not root, or no mount permission); the file size limit "
                        "case covers the error")
        job.mkdir(parents=True)
        (job / "checkpoints").symlink_to(mount)
    try:
        first = run_maester(["train", str(DEMO_CONFIG), *args], cwd=tmp_path)
        assert first.returncode == 0, first.stderr[-2000:]
        again = ["train", str(job), "--training.steps=4"]
        if how == "file size limit":  # set in the new process before it runs: a real one
            out = subprocess.run([sys.executable, "-m", "maester", *again], cwd=tmp_path, env=clean_env(),
                                 capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
        else:
            out = run_maester(again, cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-3000:]
        assert "Traceback" not in out.stderr
        reason = "No space left on device" if how == "full tmpfs" else "File too large"
        assert "checkpoint step-4 could not be written" in out.stderr and reason in out.stderr
        assert "step-2 is unchanged" in out.stderr
        checkpoints = job / "checkpoints"
        assert os.readlink(checkpoints / "latest") == "step-2"
        assert verify_checkpoint(checkpoints / "step-2", "full") == []
        assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-2"]
    finally:
        if mount.is_mount():
            subprocess.run(["umount", str(mount)], check=True)
