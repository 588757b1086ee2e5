"""`python -m maester` and `torchrun --standalone -m maester` for the suite, as forks of a zygote (`zygote.py`).

A maester process spends seconds importing torch and maester before it does anything; the suite starts hundreds.
Each pytest worker keeps one zygote that imported them once, and `run` and `torchrun` fork a fresh process from it
for each command: its own environment (the whole of it), working directory, sys.argv and sys.path[0] as `python -m`
sets them, its stdout and stderr apart, and the interpreter's exit (threads joined, atexit hooks run). Where a
command's environment differs from the zygote's in a variable read while torch loads (`IMPORT_TIME`), the command
runs as a real process instead; `_MAESTER_TESTS_NO_FORK=1` runs them all as real processes.

`torchrun` gives each rank the variables torchrun sets for it and, as torchrun does, ends the others when one fails
and exits 1 then; what it does not have is torchrun's agent (restarts, its store, its error summary): tests of
those use `helpers.torchrun(..., agent=True)`.
"""

from __future__ import annotations

import atexit
import os
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

_zygote: Zygote | None = None
_zygote_env: dict[str, str] = {}


def _as_the_cli_sets_it(env: dict[str, str]) -> dict[str, str]:
    from maester.cpus import prefer_passive_waiting

    env = dict(env)
    prefer_passive_waiting(env)  # what `maester.cli.main` does before torch loads
    return env


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in _as_the_cli_sets_it(env).items() if k.startswith(IMPORT_TIME) and
            k not in SET_IN_THE_CHILD}


def zygote_for(env: dict[str, str]) -> Zygote | None:
    """This worker's zygote, started on first use; None where `env` needs a real process."""
    global _zygote, _zygote_env
    if os.environ.get(NO_FORK) == "1" or env.get(NO_FORK) == "1":
        return None
    wanted = _import_time(env)
    if _zygote is not None and _zygote.alive():
        return _zygote if wanted == _zygote_env else None
    from tests.helpers import clean_env

    base = clean_env()
    if _import_time(base) != wanted:
        return None
    start = dict(base, **wanted)
    log = Path(tempfile.gettempdir()) / f"maester-test-zygote-{os.getpid()}.log"
    _zygote, _zygote_env = Zygote(PRELOAD, start, log), wanted
    atexit.register(_zygote.close)
    return _zygote


def _outputs(folder: Path, name: str) -> tuple[Path, Path]:
    return folder / f"{name}.out", folder / f"{name}.err"


def _wait(zygote: Zygote, pids: list[int], timeout: float, command: list[str], logs) -> list[int | None]:
    """Statuses of `pids` once all ended, or one failed (the others are then killed, as torchrun does: they may
    wait for it in a collective; their status is None); on `timeout`, all are killed and subprocess.TimeoutExpired
    raised."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = [zygote.status(p) for p in pids]
        if all(s is not None for s in statuses):
            return statuses
        if any(s not in (0, None) for s in statuses):
            for pid in pids:
                zygote.kill(pid)
            for pid in pids:
                zygote.wait(pid, 60)
            return statuses
        if time.monotonic() > deadline:
            for pid in pids:
                zygote.kill(pid)
            out, err = _read(logs)
            raise subprocess.TimeoutExpired(command, timeout, out, err)
        time.sleep(0.02)


def _read(logs: list[tuple[Path, Path]]) -> tuple[str, str]:
    text = [[p.read_text(errors="replace") if p.exists() else "" for p in pair] for pair in logs]
    return "".join(t[0] for t in text), "".join(t[1] for t in text)


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
    """`python -m maester ARGS` as a fork; None where it must be a real process."""
    zygote = zygote_for(env)
    if zygote is None:
        return None
    command = [sys.executable, "-m", "maester", *args]
    with tempfile.TemporaryDirectory(prefix="maester-fork-") as folder:
        out, err = _outputs(Path(folder), "maester")
        pid = zygote.start("maester.cli:main", [args], out, env=_as_the_cli_sets_it(env), cwd=Path(cwd), err=str(err),
                           replace_env=True, argv=[str(REPO / "src" / "maester" / "__main__.py"), *args],
                           main="maester.__main__")
        (status,) = _wait(zygote, [pid], timeout, command, [(out, err)])
        stdout, stderr = _read([(out, err)])
    return subprocess.CompletedProcess(command, status, stdout, stderr)


def torchrun(nproc: int, args: list[str], cwd: Path, env: dict[str, str], timeout: float,
             script: Path | None = None) -> subprocess.CompletedProcess | None:
    """`torchrun --standalone --nproc_per_node=N -m maester ARGS` (or `SCRIPT ARGS`) as N forks with torchrun's
    variables, their outputs in rank order; None where it must be a real torchrun."""
    zygote = zygote_for(env)
    if zygote is None:
        return None
    target = ["-m", "maester"] if script is None else [str(script)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target,
               *args]
    if script is None:
        call, call_args = "maester.cli:main", [args]
        where = dict(argv=[str(REPO / "src" / "maester" / "__main__.py"), *args], main="maester.__main__")
    else:
        call, call_args = "runpy:run_path", [str(script), None, "__main__"]
        where = dict(argv=[str(script), *args], path0=str(Path(script).parent))
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="maester-fork-") as folder:
        logs = [_outputs(Path(folder), f"rank{r}") for r in range(nproc)]
        pids = []
        for rank in range(nproc):
            rank_env = {**(env if script else _as_the_cli_sets_it(env)), "RANK": str(rank), "LOCAL_RANK": str(rank),
                        "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default", "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                        "TORCHELASTIC_RUN_ID": "none"}
            rank_env.setdefault("OMP_NUM_THREADS", "1")
            pids.append(zygote.start(call, call_args, logs[rank][0], env=rank_env, cwd=Path(cwd),
                                     err=str(logs[rank][1]), replace_env=True, **where))
        statuses = _wait(zygote, pids, timeout, command, logs)
        stdout, stderr = _read(logs)
    return subprocess.CompletedProcess(command, 0 if all(s == 0 for s in statuses) else 1, stdout,
                                       stderr + _failures(statuses, pids))


def _failures(statuses: list[int | None], pids: list[int]) -> str:
    """The lines of torchrun's summary (ChildFailedError) for the ranks that failed on their own (not those ended
    because another failed)."""
    import signal

    lines = []
    for rank, (status, pid) in enumerate(zip(statuses, pids)):
        if status:
            cause = (f"Signal {-status} ({signal.Signals(-status).name}) received by PID {pid}" if status < 0
                     else "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
            lines.append(f"[{rank}]:\n  rank      : {rank} (local_rank: {rank})\n  exitcode  : {status} (pid: {pid})\n"
                         f"  traceback : {cause}\n")
    return "" if not lines else "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\nFailures:\n" + \
        "".join(lines)
