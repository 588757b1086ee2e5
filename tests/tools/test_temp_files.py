"""Outputs of the data tools respect the umask (readable by the other users of a shared project directory), and
their temporary files do not outlive a run: SIGTERM removes them, and a run removes what a killed one left."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import clean_env, run_maester


def docs(path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"document {i} " + "lorem ipsum dolor sit amet " * 20}) + "\n")


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664)])
def test_outputs_follow_the_umask(tmp_path, umask, mode):
    docs(tmp_path / "d.jsonl", 50)
    for fmt, outputs in (("indexed", ["out_text_document.bin", "out_text_document.idx"]),
                        ("parquet", ["out.parquet"])):
        done = subprocess.run([sys.executable, "-m", "maester", "data", "tokenize", str(tmp_path / "d.jsonl"),
                               "--output-prefix", str(tmp_path / "out"), "--tokenizer", "byte", "--format", fmt],
                              cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                              preexec_fn=lambda: os.umask(umask))
        assert done.returncode == 0, done.stderr[-2000:]
        for name in outputs:
            assert (tmp_path / name).stat().st_mode & 0o777 == mode, name


def descendants(pid: int) -> list[int]:
    from benchmarks.chaos import children_of

    found, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        found += kids
        todo += kids
    return found


def as_a_shell_starts_it() -> None:
    """A shell starts a command with SIGINT at its default and no signal blocked. A test process may have either
    otherwise (left by a library or the test runner), and the command would inherit it."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_runs_temporaries_are_removed_by_the_next_run(tmp_path):
    docs(tmp_path / "d.jsonl", 50)
    host = socket.gethostname().replace("-", "_").replace(".", "_")
    stale = tmp_path / f".out_text_document.bin.{host}-{dead_pid()}.0badcafe.tmp"
    alive = tmp_path / f".out_text_document.bin.{host}-{os.getpid()}.0badcafe.tmp"  # a run still writing
    stale.write_bytes(b"x" * 1000)
    alive.write_bytes(b"x")
    done = run_maester(["data", "tokenize", str(tmp_path / "d.jsonl"), "--output-prefix", str(tmp_path / "out"),
                        "--tokenizer", "byte"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not stale.exists() and alive.exists()


@pytest.mark.parametrize("sig,group,children", [(signal.SIGTERM, False, 0), (signal.SIGINT, True, 3),
                                                (signal.SIGINT, True, 1)])
def test_a_stopped_tokenize_leaves_no_temporary(tmp_path, sig, group, children):
    """SIGTERM to the process, and Ctrl-C (SIGINT to the whole group: the pool's workers too) once the pool is up
    (the forkserver and 2 workers: 3 descendants) or while it starts (the forkserver only)."""
    docs(tmp_path / "d.jsonl", 300000)  # some seconds of work, so that the signal finds it running
    proc = subprocess.Popen([sys.executable, "-m", "maester", "data", "tokenize", str(tmp_path / "d.jsonl"),
                             "--output-prefix", str(tmp_path / "out"), "--tokenizer", "byte", "--workers", "2"],
                            cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=as_a_shell_starts_it)
    parent = (f"this process: SIGINT {signal.getsignal(signal.SIGINT)}, "
              f"blocked {signal.pthread_sigmask(signal.SIG_BLOCK, [])}")
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out*.tmp")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.02)
    while len(descendants(proc.pid)) < children:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.005)
    assert proc.poll() is None, "tokenize ended before the signal: the test proves nothing"
    os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (parent, err[-2000:])
    assert err.count("Traceback") == 0, err[-3000:]
    assert list(tmp_path.glob(".out*")) == [] and not (tmp_path / "out_text_document.bin").exists()
