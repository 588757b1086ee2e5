"""Communication preflight: all-reduce, all-gather and reduce-scatter on the job's process group, each result checked
exactly against a value known in advance and timed, before a job spends its allocation on training.

The inputs are small integers, placed so that at most `REDUCE_TERMS` ranks add a non-zero value to any element: every
partial sum is then exactly representable in float32, bfloat16 and float16, whatever order the backend adds in, so a
result is right or wrong, never rounded. Bandwidths follow nccl-tests (its doc/PERFORMANCE.md): `bytes` is the
all-reduce buffer, the all-gather output or the reduce-scatter input; algbw = bytes / time; busbw = algbw * 2(n-1)/n
for all-reduce and algbw * (n-1)/n for all-gather and reduce-scatter; the time of a call is the slowest rank's.

A check that does not finish within `timeout_s` (a rank that never joins, a stuck link) is caught by a watchdog
thread: rank 0 writes the report naming the check, and every process exits with status 1, since a collective that
never returns cannot be abandoned.

Fault injection for tests, as `_MAESTER_FAULT` in `maester.train.faults`: `_MAESTER_PREFLIGHT_FAULT=corrupt:<rank>`
adds 1 to the first input element of that rank in every check (a wrong result wherever it lands);
`hang:<rank>` makes that rank sleep, before its first collective, until the watchdog ends it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from maester.config import PreflightConfig
from maester.files import write_atomically
from maester.parallel.devices import process_group_backend
from maester.parallel.precision import DTYPES
from maester.progress import stderr_line

REPORT_FILE = "preflight.json"
FAULT_ENV = "_MAESTER_PREFLIGHT_FAULT"
OPS = ("all_reduce", "all_gather", "reduce_scatter")
WARMUP = 3
"""Untimed calls of each collective before the checks and the timed iterations."""
REDUCE_TERMS = 8
"""At most this many ranks add a non-zero value (|v| <= 2) to any one element, so partial sums stay exact."""
REPORT_GRACE_S = 5.0
"""On a timeout, ranks other than 0 exit this much later, so that rank 0 writes the report before a launcher
stops it."""


class PreflightFailed(RuntimeError):
    """A collective gave a wrong result and the run was asked to stop there."""


@dataclass
class CheckResult:
    op: str
    dtype: str
    size: int
    """The size asked for, in bytes."""
    bytes: int
    """The size used: whole elements, and for all-gather and reduce-scatter a whole number of them per rank."""
    ok: bool
    max_error: float
    """The largest absolute difference from the analytic result over all ranks, in checks before and after the
    timed iterations; infinite (null in the JSON report) where a result was not finite."""
    time_s: float
    algbw_gbps: float
    busbw_gbps: float


@dataclass
class PreflightReport:
    world_size: int
    backend: str
    device: str
    hosts: list[str]
    """The host name of each rank."""
    iterations: int
    warmup: int
    timeout_s: float
    results: list[CheckResult] = field(default_factory=list)
    stopped: str | None = None
    """Why the preflight ended before its last check: a wrong result with fail-fast, or a timeout."""

    @property
    def ok(self) -> bool:
        return self.stopped is None and all(r.ok for r in self.results)

    def to_json(self) -> str:
        data = {"ok": self.ok, **asdict(self)}
        for result in data["results"]:  # JSON has no infinity: null stands for a result that was not finite
            result["max_error"] = result["max_error"] if math.isfinite(result["max_error"]) else None
        return json.dumps(data, indent=2, allow_nan=False) + "\n"

    def write(self, job_dir: Path) -> Path:
        job_dir.mkdir(parents=True, exist_ok=True)
        path = job_dir / REPORT_FILE
        write_atomically(path, self.to_json())
        return path


# ---------------------------------------------------------------- inputs and their analytic results


def reduce_input(rank: int, world: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s addend for elements start..start+count: ((rank + 2i) mod 5) - 2 where rank is one of the
    `REDUCE_TERMS` ranks i, i+1, ... (mod world) that contribute to element i, else 0."""
    i = torch.arange(start, start + count, device=device)
    value = (rank + 2 * i) % 5 - 2
    return torch.where((rank - i) % world < min(world, REDUCE_TERMS), value, 0)


def reduce_expected(world: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    """The sum over all ranks of `reduce_input` for elements start..start+count."""
    i = torch.arange(start, start + count, device=device)
    return sum(reduce_input_of_contributor(i, k, world) for k in range(min(world, REDUCE_TERMS)))


def reduce_input_of_contributor(i: torch.Tensor, k: int, world: int) -> torch.Tensor:
    """The addend of the k-th rank that contributes to element i, rank (i + k) mod world."""
    return ((i + k) % world + 2 * i) % 5 - 2


def gather_input(rank: int, count: int, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s all-gather chunk: ((131 rank + i) mod 251) - 125, distinct between ranks and exact in 16 bits."""
    return (131 * rank + torch.arange(count, device=device)) % 251 - 125


# ---------------------------------------------------------------- fault injection


def injected_fault(rank: int) -> str | None:
    """`corrupt` or `hang` when `_MAESTER_PREFLIGHT_FAULT` names this rank."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    match = re.fullmatch(r"(corrupt|hang):(\d+)", spec)
    if not match:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected corrupt:<rank> or hang:<rank>")
    return match.group(1) if int(match.group(2)) == rank else None


# ---------------------------------------------------------------- the watchdog


class Watchdog:
    """Ends the process when one check runs past its deadline, after `on_timeout(check)` has reported it."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[str], None]):
        self.timeout_s, self.on_timeout = timeout_s, on_timeout
        self._lock = threading.Lock()
        self._check: str | None = None
        self._deadline = math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="preflight-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @contextmanager
    def arm(self, check: str) -> Iterator[None]:
        with self._lock:
            self._check, self._deadline = check, time.monotonic() + self.timeout_s
        try:
            yield
        finally:
            with self._lock:
                self._check, self._deadline = None, math.inf

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            with self._lock:
                check, late = self._check, time.monotonic() > self._deadline
            if check is not None and late:
                try:
                    self.on_timeout(check)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(1)


# ---------------------------------------------------------------- the checks


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw of nccl-tests: the share of the data each rank's link carries."""
    return (2 if op == "all_reduce" else 1) * (world - 1) / world


class Preflight:
    """The checks of one process, one op, dtype and size at a time; every rank runs the same sequence."""

    def __init__(self, cfg: PreflightConfig, device: torch.device, fail_fast: bool):
        self.cfg, self.device, self.fail_fast = cfg, device, fail_fast
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.fault = injected_fault(self.rank)

    def run(self, job_dir: Path) -> PreflightReport:
        report = PreflightReport(self.world, dist.get_backend(), str(self.device), [], self.cfg.iterations, WARMUP,
                                 self.cfg.timeout_s)
        with Watchdog(self.cfg.timeout_s, lambda check: self._timed_out(report, check, job_dir)) as watchdog:
            with watchdog.arm("gathering host names"):
                hosts: list[str | None] = [None] * self.world
                dist.all_gather_object(hosts, socket.gethostname())
                report.hosts = [str(h) for h in hosts]
            self._print_header(report)
            for op, dtype, size in itertools.product(OPS, self.cfg.dtypes, self.cfg.sizes):
                with watchdog.arm(f"{op} {dtype} {format_size(size)}"):
                    result = self._check(op, dtype, size)
                report.results.append(result)
                self._print_row(result)
                if not result.ok and self.fail_fast:
                    report.stopped = (f"wrong result: {op} {dtype} {format_size(result.bytes)} is off by up to "
                                      f"{result.max_error:g}")
                    break
        if self.rank == 0:
            path = report.write(job_dir)
            wrong = [r for r in report.results if not r.ok]
            summary = (f"{len(report.results)} checks, all correct" if not wrong else
                       f"{len(wrong)} of {len(report.results)} checks gave WRONG results")
            print(f"preflight: {summary}{'; stopped: ' + report.stopped if report.stopped else ''}; report {path}",
                  flush=True)
        if report.stopped:
            raise PreflightFailed(f"preflight stopped the job: {report.stopped} (report in {job_dir / REPORT_FILE})")
        return report

    def _check(self, op: str, dtype_name: str, size: int) -> CheckResult:
        dtype = DTYPES[dtype_name]
        per_rank = max(size // dtype.itemsize // self.world, 1)
        count = max(size // dtype.itemsize, 1) if op == "all_reduce" else per_rank * self.world
        if self.fault == "hang":
            threading.Event().wait()  # until the watchdog ends the process
        call, check = self._collective(op, dtype, count)
        for _ in range(WARMUP):
            call()
        error = check()
        # all-reduce works in place, and summing its own result again and again would overflow: zeros stay zeros
        timing = torch.zeros(count, dtype=dtype, device=self.device) if op == "all_reduce" else None
        seconds = self._time(call if timing is None else lambda: dist.all_reduce(timing))
        error = torch.maximum(error, check())
        agreed = torch.stack([error.double(), torch.tensor(seconds, dtype=torch.float64, device=self.device)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank sees the worst error and the slowest time
        max_error, seconds = agreed.tolist()
        nbytes = count * dtype.itemsize
        algbw = nbytes / max(seconds, 1e-12) / 1e9
        return CheckResult(op, dtype_name, size, nbytes, max_error == 0, max_error, seconds, algbw,
                           algbw * bus_factor(op, self.world))

    def _collective(self, op: str, dtype: torch.dtype, count: int) -> tuple[Callable[[], None],
                                                                             Callable[[], torch.Tensor]]:
        """The collective on this rank's known inputs, and a check that calls it once more and returns the largest
        difference of this rank's result from the analytic one."""
        r, n, device = self.rank, self.world, self.device
        chunk = count // n
        if op == "all_reduce":
            source = reduce_input(r, n, 0, count, device).to(dtype)
            expected = reduce_expected(n, 0, count, device).float()
            buffer = torch.empty_like(source)

            def run() -> None:
                buffer.copy_(source)
                self._corrupt(buffer)
                dist.all_reduce(buffer)

            result = buffer
        elif op == "all_gather":
            inp = gather_input(r, chunk, device).to(dtype)
            self._corrupt(inp)
            expected = torch.cat([gather_input(q, chunk, device) for q in range(n)]).float()
            result = torch.empty(count, dtype=dtype, device=device)

            def run() -> None:
                dist.all_gather_into_tensor(result, inp)
        else:
            inp = reduce_input(r, n, 0, count, device).to(dtype)
            self._corrupt(inp)
            expected = reduce_expected(n, r * chunk, chunk, device).float()
            result = torch.empty(chunk, dtype=dtype, device=device)

            def run() -> None:
                dist.reduce_scatter_tensor(result, inp)

        def check() -> torch.Tensor:
            result.fill_(float("nan"))  # nothing of an earlier call can pass for this one's result
            run()
            return (result.float() - expected).abs().nan_to_num(nan=math.inf).max()

        return run, check

    def _corrupt(self, t: torch.Tensor) -> None:
        if self.fault == "corrupt":
            t.view(-1)[0] += 1

    def _time(self, call: Callable[[], object]) -> float:
        """Seconds per call over `iterations` calls, started together on every rank."""
        sync = torch.zeros(1, device=self.device)
        dist.all_reduce(sync)
        self._synchronize()
        start = time.perf_counter()
        for _ in range(self.cfg.iterations):
            call()
        self._synchronize()
        return (time.perf_counter() - start) / self.cfg.iterations

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed_out(self, report: PreflightReport, check: str, job_dir: Path) -> None:
        report.stopped = f"timeout: {check} did not finish within {self.cfg.timeout_s:g} s"
        stderr_line(f"preflight: rank {self.rank}: {report.stopped}; stopping the job")
        if self.rank == 0:
            path = report.write(job_dir)
            print(f"preflight: stopped by a timeout; report {path}", flush=True)
        else:
            time.sleep(REPORT_GRACE_S)

    def _print_header(self, report: PreflightReport) -> None:
        if self.rank != 0:
            return
        hosts = sorted(set(report.hosts))
        print(f"preflight: {self.world} rank(s) on {len(hosts)} host(s) ({', '.join(hosts)}), backend "
              f"{report.backend}, device {report.device}; {self.cfg.iterations} timed call(s) after {WARMUP} warmup",
              flush=True)
        print(f"{'op':<15}{'dtype':<10}{'bytes':>10}{'time us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"
              f"{'max error':>11}  result", flush=True)

    def _print_row(self, r: CheckResult) -> None:
        if self.rank == 0:
            print(f"{r.op:<15}{r.dtype:<10}{format_size(r.bytes):>10}{r.time_s * 1e6:>12.1f}{r.algbw_gbps:>12.3f}"
                  f"{r.busbw_gbps:>12.3f}{r.max_error:>11g}  {'ok' if r.ok else 'WRONG'}", flush=True)


def run_preflight(cfg: PreflightConfig, job_dir: Path, device: torch.device, fail_fast: bool) -> PreflightReport:
    """Run every check on the process group (one of this process alone when there is none), print a table and
    write `<job_dir>/preflight.json` on rank 0. With `fail_fast`, a wrong result raises `PreflightFailed` on every
    rank after the same check; without it, wrong results are reported and the run goes on."""
    own_group = not dist.is_initialized()
    if own_group:  # one process without torchrun: a group of one still runs the same calls
        dist.init_process_group(process_group_backend(device.type), store=dist.HashStore(), rank=0,
                                world_size=1)
    try:
        return Preflight(cfg, device, fail_fast).run(Path(job_dir))
    finally:
        if own_group:
            dist.destroy_process_group()
