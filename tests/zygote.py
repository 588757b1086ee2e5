"""A process that imports torch and maester once, then forks a fresh process for each command it is sent.

The seconds of a Python process are its imports (torch, maester, torchao: about ten seconds of CPU each on the
machines the suite runs on); the combination matrix starts hundreds of processes, each of which must be fresh: a
run killed with SIGKILL, a resume or an export that shares nothing with the run that wrote its checkpoint. A fork of
this process is such a process, without the imports: it has done no work, started no thread of torch's, opened no
process group and loaded no checkpoint. Each child gets its own process group (so that a SIGKILL takes its helpers
too), its environment, working directory and a log file for its stdout and stderr, and calls one function.

Protocol, one JSON object per line. In (stdin): {"id": n, "call": "module:function", "args": [...], "env": {...},
"cwd": path, "log": path}, and optionally "err": path (stderr apart from stdout), "replace_env": true (`env` is the
whole environment, not additions) "argv": [...] (sys.argv, and sys.path[0] the working directory, as
`python -m` has them), "path0" (sys.path[0] instead: a script's folder) and "main" (the module that is
`__main__`, as `python -m MODULE` makes it). Out (stdout): {"id": n, "pid": p} once the child runs, and
{"pid": p, "status": s, "cpu": c} when it ended (its exit code, or minus the signal that ended it; the CPU seconds
it and the processes it waited for took). End of input: the zygote kills the children it still has and exits; they
die with it too, however it ends. A child is what a new process would be: its environment is read anew where
torch's import did not already read it (the temporary folder too), and Python's and numpy's random generators are
seeded anew; only the hash seed of str is its siblings'.

Run as `python -m tests.zygote MODULE...`: the modules to import first.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import sys


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _child(request: dict) -> None:
    """Runs in the forked child and never returns."""
    code = 1
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: ends with the zygote, however it ends
        os.setpgid(0, 0)
        os.chdir(request["cwd"])
        if request.get("replace_env"):
            os.environ.clear()
        os.environ.update(request["env"])
        if "tempfile" in sys.modules:  # the folder it chose here; a new process takes TMPDIR's on first use
            sys.modules["tempfile"].tempdir = None
        if "random" in sys.modules:  # a new process seeds it from the OS, not as its siblings
            sys.modules["random"].seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if "OMP_NUM_THREADS" in os.environ and "torch" in sys.modules:  # OpenMP read it when torch loaded here
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if "argv" in request:
            sys.argv = request["argv"]
            sys.path[0] = request.get("path0", os.getcwd())
        if "main" in request:  # what multiprocessing's spawned children import as their __main__
            sys.modules["__main__"] = importlib.import_module(request["main"])
        for fd, key in ((1, "log"), (2, "err" if "err" in request else "log")):
            log = os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(log, fd)
            os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        module, _, name = request["call"].partition(":")
        function = getattr(importlib.import_module(module), name)
        try:
            function(*request["args"])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)  # as the interpreter does
    except BaseException:  # noqa: BLE001 (what failed goes to the child's log, and its exit code says so)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            _shutdown()
        except BaseException:  # noqa: BLE001
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _shutdown() -> None:
    """What the interpreter does at exit: wait for the threads that are not daemons, then run the atexit hooks."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()


_live: set[int] = set()


def _reap() -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _live.discard(pid)
        _send({"pid": pid, "status": os.waitstatus_to_exitcode(status),
               "cpu": round(usage.ru_utime + usage.ru_stime, 3)})


def main(preload: list[str]) -> None:
    for module in preload:
        importlib.import_module(module)
    _send({"ready": True})
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        _reap()
        if not ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the caller is gone: so are the children it left
            for pid in _live:
                try:
                    os.killpg(pid, 9)
                except ProcessLookupError:
                    pass
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(request)
            _live.add(pid)
            _send({"id": request["id"], "pid": pid})


if __name__ == "__main__":
    main(sys.argv[1:])
