"""Fresh processes for the combination matrix, forked from a zygote (`zygote.py`) that imported torch and maester
once: `Zygote.start` a function in a new process, `wait` for it, `kill` it (SIGKILL to its process group), and
`Ranks`, the processes of one multi-process run, launched with the variables torchrun sets."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Zygote:
    """A zygote process importing `preload`, with `env` as its environment (its children add their own)."""

    def __init__(self, preload: list[str], env: dict[str, str], log: Path, timeout: float = 600):
        self._log = open(log, "a")
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", *preload], cwd=REPO,
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      text=True, bufsize=1)
        self._lock = threading.Condition()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._status: dict[int, int] = {}  # pid -> exit status
        self.cpu_seconds = 0.0  # of the children that ended
        self._live: set[int] = set()
        self._ready = False
        self._next = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        with self._lock:
            if not self._lock.wait_for(lambda: self._ready or self._proc.poll() is not None, timeout):
                raise TimeoutError(f"the zygote did not import {preload} within {timeout} s")
        if not self._ready:
            raise RuntimeError(f"the zygote ended with {self._proc.returncode}; see {log}")

    def _read(self) -> None:
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._lock:
                if "ready" in message:
                    self._ready = True
                elif "status" in message:
                    self._status[message["pid"]] = message["status"]
                    self.cpu_seconds += message["cpu"]
                    self._live.discard(message["pid"])
                else:  # sent before any status of this child: a status held for its pid is an earlier child's
                    self._pids[message["id"]] = message["pid"]
                    self._status.pop(message["pid"], None)
                    self._live.add(message["pid"])
                self._lock.notify_all()

    def start(self, call: str, args: list, log: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None, **options) -> int:
        """A new process calling `call` ("module:function") with `args` (JSON values), its output in `log`;
        returns its pid. `options`: the protocol's optional keys (`zygote.py`)."""
        with self._lock:
            request_id, self._next = self._next, self._next + 1
        request = {"id": request_id, "call": call, "args": args, "env": env or {}, "cwd": str(cwd or REPO),
                   "log": str(log), **options}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        with self._lock:
            if not self._lock.wait_for(lambda: request_id in self._pids or self._proc.poll() is not None, 60):
                raise TimeoutError("the zygote did not fork within 60 s")
            if request_id not in self._pids:
                raise RuntimeError(f"the zygote ended with {self._proc.returncode}")
            return self._pids[request_id]

    def alive(self) -> bool:
        return self._proc.poll() is None

    def status(self, pid: int) -> int | None:
        with self._lock:
            return self._status.get(pid)

    def wait(self, pid: int, timeout: float) -> int | None:
        """The exit status of `pid` (minus the signal that ended it); None if it still runs after `timeout` s."""
        with self._lock:
            self._lock.wait_for(lambda: pid in self._status, timeout)
            return self._status.get(pid)

    def kill(self, pid: int) -> None:
        """SIGKILL to the process group of `pid` (it and the processes it started), unless it has ended."""
        with self._lock:
            if pid in self._status:
                return
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        with self._lock:
            live = sorted(self._live)
        for pid in live:
            self.kill(pid)
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """The `world` processes of one run of `maester ARGV`, each with the variables torchrun gives its ranks (one
    node); their logs are `logs[rank]`."""

    def __init__(self, zygote: Zygote, world: int, argv: list[str], log_dir: Path, env: dict[str, str],
                 name: str):
        self.zygote, self.world = zygote, world
        self.logs = [log_dir / f"{name}-rank{r}.log" for r in range(world)]
        base = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port())} if world > 1 else {}
        self.pids = [zygote.start("maester.cli:main", [argv], self.logs[r],
                                  env={**env, **base, "RANK": str(r), "LOCAL_RANK": str(r)})
                     for r in range(world)]

    def statuses(self) -> list[int | None]:
        return [self.zygote.status(p) for p in self.pids]

    def wait(self, timeout: float, every: bool = False) -> list[int | None]:
        """Wait until every rank ended, or one failed (unless `every`; the others are then killed: they may wait
        for it in a collective), or `timeout` s passed (all are killed); returns their statuses (None: killed while
        running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            statuses = self.statuses()
            if all(s is not None for s in statuses) or (not every and any(s not in (0, None) for s in statuses)):
                break
            time.sleep(0.05)
        statuses = self.statuses()
        if any(s != 0 for s in statuses):
            self.kill()
        return statuses

    def kill(self) -> None:
        for pid in self.pids:
            self.zygote.kill(pid)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of each rank's log, failed ranks first."""
        order = sorted(range(self.world), key=lambda r: self.statuses()[r] in (0, None))
        return "\n".join(f"--- rank {r} ({self.statuses()[r]}): " + self.logs[r].read_text()[-chars:]
                         for r in order if self.logs[r].exists())
