"""`python -m maester`, `torchrun --standalone -m maester` and `python SCRIPT` (or `-m MODULE`) for the suite, as forks
of a zygote (`zygote.py`).

A maester process spends seconds importing torch and maester before it does anything; the suite starts hundreds.
Each pytest worker keeps one zygote that imported them once, and `run`, `run_python` and `torchrun` (or `start`,
which does not wait: a `Forked`, with Popen's methods) fork a fresh process from it for each command: its own
environment (the whole of it), working directory, sys.argv and sys.path[0] as python sets them, its stdout and
stderr apart, and the interpreter's exit (threads joined, atexit hooks run). Where a command's environment differs
from the zygote's in a variable read while torch loads (`IMPORT_TIME`), the command runs as a real process instead;
`_MAESTER_TESTS_NO_FORK=1` runs them all as real processes. (OpenMP waits passively in every fork, as the zygote's
`maester` environment set it: a real `python SCRIPT` would spin, which changes timings only.)

`torchrun` gives each rank the variables torchrun sets for it and, as torchrun does, ends the others when one fails
and exits 1 then; what it does not have is torchrun's agent (restarts, its store, its error summary): tests of
those use `helpers.torchrun(..., agent=True)`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.processes import REPO, Zygote, free_port

NO_FORK = "_MAESTER_TESTS_NO_FORK"
PRELOAD = ["maester.cli", "maester.train.trainer"]
IMPORT_TIME = ("OMP_", "KMP_", "GOMP_", "MKL_", "PYTHON", "LD_", "TORCH", "PYTORCH", "CUDA", "MALLOC_", "GLIBC",
               "NUMEXPR_", "OPENBLAS_")
SET_IN_THE_CHILD = {"OMP_NUM_THREADS"}  # the zygote's child sets torch's threads from it
READ_WHEN_USED = {"TORCHINDUCTOR_CACHE_DIR"}  # read when used, not while torch loads
# The worker's environment as it started (tests/conftest.py imports this module first). Libraries the tests import
# in the worker set variables in it (threadpoolctl KMP_DUPLICATE_LIB_OK, Inductor TORCHINDUCTOR_CACHE_DIR); they
# would set them in the command too, so such drift does not make a command's environment differ from the zygote's.
# Without this, every command of a worker after the first such import was a real interpreter: a hundred a run.
_STARTING = dict(os.environ)

_zygote: Zygote | None = None
_zygote_start: dict[str, str] = {}


def _as_the_cli_sets_it(env: dict[str, str]) -> dict[str, str]:
    from maester.cpus import prefer_passive_waiting

    env = dict(env)
    prefer_passive_waiting(env)  # what `maester.cli.main` does before torch loads
    return env


def _import_time(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` torch reads as it loads, but those the worker's own imports set (`_STARTING`)."""
    return {k: v for k, v in _as_the_cli_sets_it(env).items() if k.startswith(IMPORT_TIME) and
            k not in SET_IN_THE_CHILD | READ_WHEN_USED and not (v == os.environ.get(k) != _STARTING.get(k))}


def zygote_for(env: dict[str, str]) -> Zygote | None:
    """This worker's zygote, started on first use; None where `env` needs a real process."""
    global _zygote, _zygote_start
    if os.environ.get(NO_FORK) == "1" or env.get(NO_FORK) == "1":
        return None
    wanted = _import_time(env)
    if _zygote is not None and _zygote.alive():
        return _zygote if wanted == _import_time(_zygote_start) else None
    from tests.helpers import clean_env

    base = clean_env()
    if _import_time(base) != wanted:
        return None
    start = dict(base, **wanted)
    log = Path(tempfile.gettempdir()) / f"maester-test-zygote-{os.getpid()}.log"
    _zygote, _zygote_start = Zygote(PRELOAD, start, log), start
    atexit.register(_zygote.close)
    return _zygote


def _outputs(folder: Path, name: str) -> tuple[Path, Path]:
    return folder / f"{name}.out", folder / f"{name}.err"


class Forked:
    """A command under way as forks (one, or torchrun's ranks), with the part of `subprocess.Popen` the tests use:
    `pid` (the first process; each is the leader of its own process group), `poll`, `wait`, `communicate`,
    `send_signal`, `kill`, `returncode` (for ranks, torchrun's: 0, or 1 once one failed and the others were ended,
    as torchrun ends them: they may wait for it in a collective). Its outputs are files, read at the end."""

    def __init__(self, zygote: Zygote, command: list[str], folder: Path, pids: list[int],
                 logs: list[tuple[Path, Path]]):
        self.zygote, self.args, self._folder, self.pids, self._logs = zygote, command, folder, pids, logs
        self.pid = pids[0]
        self.returncode: int | None = None
        self.statuses: list[int | None] = []

    def poll(self) -> int | None:
        if self.returncode is not None:  # once ended, its pids may be a later command's
            return self.returncode
        statuses = [self.zygote.status(p) for p in self.pids]
        if len(self.pids) > 1 and any(s not in (0, None) for s in statuses) and None in statuses:
            for pid in self.pids:
                self.zygote.kill(pid)
            statuses = [self.zygote.wait(p, 60) for p in self.pids]
        if any(s is None for s in statuses):
            return None
        self.statuses = statuses
        self.returncode = statuses[0] if len(self.pids) == 1 else 0 if all(s == 0 for s in statuses) else 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """`sig` to each process's group (it and the processes it started)."""
        for pid in self.pids:
            if self.zygote.status(pid) is None:
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        """SIGKILL to each process's group; returns once they ended."""
        for pid in self.pids:
            self.zygote.kill(pid)
        for pid in self.pids:
            self.zygote.wait(pid, 60)

    def output(self) -> tuple[str, str]:
        """stdout and stderr so far (the ranks' in rank order; once ended, torchrun's summary of failed ranks)."""
        text = [[p.read_text(errors="replace") if p.exists() else "" for p in pair] for pair in self._logs]
        out, err = "".join(t[0] for t in text), "".join(t[1] for t in text)
        if len(self.pids) > 1 and self.returncode is not None:
            err += _failures(self.statuses, self.pids)
        return out, err

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end (on `timeout`, every process is killed and subprocess.TimeoutExpired raised, with the
        outputs so far), then the outputs; the folder holding them is removed."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired as e:
            self.kill()
            e.output, e.stderr = self.output()
            raise
        try:
            return self.output()
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)


def start(args: list[str], cwd: Path, env: dict[str, str], nproc: int = 0,
          script: Path | None = None, module: str | None = None) -> Forked | None:
    """`python -m maester ARGS` (`nproc` 0), or `torchrun --standalone --nproc_per_node=N -m maester ARGS` (or
    `SCRIPT ARGS`, or `-m MODULE ARGS`), started as forks with torchrun's variables for each rank; None where it
    must be real."""
    zygote = zygote_for(env)
    if zygote is None:
        return None
    target = ["-m", module or "maester"] if script is None else [str(script)]
    if nproc == 0:
        command = [sys.executable, *target, *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   *target, *args]
    if module is not None:
        call, call_args = "runpy:run_module", [module, None, "__main__", True]
        where = dict(argv=[module, *args], path0=str(cwd))
    elif script is None:
        call, call_args = "maester.cli:main", [args]
        where = dict(argv=[str(REPO / "src" / "maester" / "__main__.py"), *args], main="maester.__main__")
        env = _as_the_cli_sets_it(env)
    else:
        call, call_args = "runpy:run_path", [str(script), None, "__main__"]
        where = dict(argv=[str(script), *args], path0=str(Path(script).parent))
    folder = Path(tempfile.mkdtemp(prefix="maester-fork-"))
    port = str(free_port())
    logs, pids = [], []
    for rank in range(max(nproc, 1)):
        logs.append(_outputs(folder, f"rank{rank}"))
        rank_env = env if nproc == 0 else {
            **env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none"}
        if nproc:
            rank_env.setdefault("OMP_NUM_THREADS", "1")
        pids.append(zygote.start(call, call_args, logs[rank][0], env=rank_env, cwd=Path(cwd),
                                 err=str(logs[rank][1]), replace_env=True, **where))
    return Forked(zygote, command, folder, pids, logs)


class Real(Forked):
    """A real `python -m maester ARGS` in a process group of its own, with `Forked`'s methods."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]):
        folder = Path(tempfile.mkdtemp(prefix="maester-real-"))
        self._logs = [_outputs(folder, "maester")]
        self._folder = folder
        self.args = [sys.executable, "-m", "maester", *args]
        with open(self._logs[0][0], "w") as out, open(self._logs[0][1], "w") as err:
            self._proc = subprocess.Popen(self.args, cwd=cwd, env=env, stdout=out, stderr=err,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid, self.pids, self.returncode, self.statuses = self._proc.pid, [self._proc.pid], None, []

    def poll(self) -> int | None:
        self.returncode = self._proc.poll()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self._proc.poll() is None:
            os.killpg(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
        self._proc.wait()


def start_or_real(args: list[str], cwd: Path, env: dict[str, str]) -> Forked:
    """`python -m maester ARGS` started, in a process group of its own: a fork, or where it must be, a real
    process (`Real`), with the same methods."""
    return start(args, cwd, env) or Real(args, cwd, env)


def _completed(forked: Forked | None, timeout: float) -> subprocess.CompletedProcess | None:
    if forked is None:
        return None
    stdout, stderr = forked.communicate(timeout)
    return subprocess.CompletedProcess(forked.args, forked.returncode, stdout, stderr)


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
    """`python -m maester ARGS` as a fork; None where it must be a real process."""
    return _completed(start(args, cwd, env), timeout)


def run_python(args: list[str], cwd: Path, env: dict[str, str], timeout: float, script: Path | None = None,
               module: str | None = None) -> subprocess.CompletedProcess | None:
    """`python SCRIPT ARGS` or `python -m MODULE ARGS` as a fork; None where it must be a real process."""
    return _completed(start(args, cwd, env, 0, script, module), timeout)


def torchrun(nproc: int, args: list[str], cwd: Path, env: dict[str, str], timeout: float,
             script: Path | None = None) -> subprocess.CompletedProcess | None:
    """`torchrun --standalone --nproc_per_node=N -m maester ARGS` (or `SCRIPT ARGS`) as N forks with torchrun's
    variables, their outputs in rank order; None where it must be a real torchrun."""
    return _completed(start(args, cwd, env, nproc, script), timeout)


def _failures(statuses: list[int | None], pids: list[int]) -> str:
    """The lines of torchrun's summary (ChildFailedError) for the ranks that failed on their own (not those ended
    because another failed)."""
    lines = []
    for rank, (status, pid) in enumerate(zip(statuses, pids)):
        if status:
            cause = (f"Signal {-status} ({signal.Signals(-status).name}) received by PID {pid}" if status < 0
                     else "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
            lines.append(f"[{rank}]:\n  rank      : {rank} (local_rank: {rank})\n  exitcode  : {status} (pid: {pid})\n"
                         f"  traceback : {cause}\n")
    return "" if not lines else "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\nFailures:\n" + \
        "".join(lines)
