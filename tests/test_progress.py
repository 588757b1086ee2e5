"""Long commands show a progress bar with an ETA on a terminal (a real pseudo-terminal here) and nothing of it when
stderr is a pipe or a file (for `train`, asserted on a piped run in test_nonfinite)."""

from __future__ import annotations

import fcntl
import io
import os
import re
import struct
import subprocess
import sys
import termios

import pytest

from tests.helpers import DEMO_CONFIG, clean_env, tiny_overrides

# tqdm's "NN%|bar| n/total [elapsed<remaining" with a known total: the remaining time is the ETA.
BAR_WITH_ETA = re.compile(r"(\d+)%\|[^|\n]*\| *[\d.]+k?/[\d.]+k? *\[\d\d:\d\d<\d\d:\d\d")


def run_on_terminal(args: list[str], cwd) -> tuple[int, str]:
    """Run `maester ARGS` with stderr on a pseudo-terminal; returns the exit code and what the terminal showed."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen([sys.executable, "-m", "maester", *args], cwd=cwd, env=clean_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    return proc.wait(timeout=300), shown.decode(errors="replace")


def run_piped(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "maester", *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


def tokenize_args(corpus, out) -> list[str]:
    return ["data", "tokenize", str(corpus), "--output-prefix", str(out), "--tokenizer", "byte"]


@pytest.mark.parametrize("command", ["tokenize", "train"])
def test_bar_with_eta_on_a_terminal_and_quiet_otherwise(corpus, tmp_path, command):
    def args(name):
        if command == "tokenize":
            return tokenize_args(corpus, tmp_path / name / "tokens")
        return ["train", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", name, training__steps=4,
                                                           checkpoint__interval=0, checkpoint__save_final="false")]

    code, shown = run_on_terminal(args("tty"), tmp_path)
    assert code == 0, shown[-3000:]
    finals = [m for m in BAR_WITH_ETA.finditer(shown) if m.group(1) == "100"]
    assert finals, shown[-3000:]
    if command == "tokenize":  # piped training runs: test_nonfinite's stop test
        piped = run_piped(args("pipe"), tmp_path)
        assert piped.returncode == 0, piped.stderr[-3000:]
        assert_no_bar(piped.stderr)


def assert_no_bar(stderr: str) -> None:
    assert not BAR_WITH_ETA.search(stderr) and "%|" not in stderr


def test_record_count_of_parquet_and_jsonl(corpus, tmp_path):
    from maester.data.records import RecordReader

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(37)))
    assert RecordReader([str(corpus), str(jsonl)]).count_records() == 200 + 37
    (tmp_path / "docs.jsonl.gz").write_bytes(b"")
    assert RecordReader([str(jsonl), str(tmp_path / "docs.jsonl.gz")]).count_records() is None


def test_progress_lines_off_a_terminal_come_at_the_start_every_so_often_and_at_the_end(capsys):
    """Where stderr is not a terminal a command that can run for minutes (`plan --ranks all`) prints plain lines:
    one before the first item, one whenever `every` seconds have passed since the last, and one after the last."""
    from maester.progress import progress_bar, progress_lines

    ticks = iter([0, 10, 40, 50, 75, 80])  # the clock at the start and after each of 5 items
    assert list(progress_lines("ranks", range(5), 5, " ranks", every=30, clock=lambda: next(ticks))) == [0, 1, 2, 3, 4]
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["ranks: 0 of 5 ranks", "ranks: 2 of 5 ranks in 40 s, about 60 s left",
                     "ranks: 4 of 5 ranks in 75 s, about 19 s left", "ranks: 5 of 5 ranks in 80 s"], lines
    assert list(progress_bar("ranks", range(3), total=3, lines_every=30)) == [0, 1, 2]  # stderr is captured here
    assert capsys.readouterr().err.splitlines()[0] == "ranks: 0 of 3 it"


class Writes(io.StringIO):
    """A stderr that keeps its writes apart."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def write(self, s):
        self.calls.append(s)
        return super().write(s)


def test_an_error_line_of_the_cli_is_one_write(monkeypatch, tmp_path):
    # the ranks of a job share one stderr: a line written in two parts (print's text, then its newline) can run
    # into another rank's line
    from maester.cli import main

    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["train", str(tmp_path / "missing.toml")])
    assert stop.value.code == 2
    lines = [w for w in stderr.calls if "maester train: error:" in w]
    assert len(lines) == 1 and lines[0].endswith("missing.toml does not exist\n"), stderr.calls
