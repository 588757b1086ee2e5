import os

# Inductor's CPU kernels are built without SIMD (scalar C++): a build no GPU run makes, and 40% less compiler time
# per kernel, which is most of what a cold compile costs here. Set before anything imports torch._inductor.config.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

# Idle OpenMP threads of the workers' own torch (the in-process tests) sleep, as every maester command's do
# (`maester.cpus`): with more workers than CPUs, libgomp's spinning after each parallel region took a quarter of
# their CPU (tests/models and tests/parallel/test_precision.py alone: 36 -> 26 CPU s). Set before torch loads.
from maester.cpus import prefer_passive_waiting  # noqa: E402

prefer_passive_waiting()

import pytest  # noqa: E402

import tests.forks  # noqa: E402, F401  (first: it keeps the worker's environment as it starts)
from tests import forkserver  # noqa: E402

forkserver.install()  # the worker's one forkserver imports what every test that uses it needs

from tests.helpers import write_corpus  # noqa: E402

# Every metrics.jsonl row and events.jsonl line the suite writes is checked against the documented schema
# (maester.train.metrics_file), in this process and in the runs it starts.
os.environ["_MAESTER_CHECK_RECORDS"] = "1"


@pytest.fixture
def corpus(tmp_path):
    """A real Parquet file of short pseudo-English documents."""
    return write_corpus(tmp_path / "data" / "corpus.parquet")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Built-in corpora and other caches go to the test's own directory, never the user's home."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    """With _MAESTER_TEST_TIMES=FILE, also each test's CPU seconds (its worker's and those of the processes it
    waited for), wall seconds (setup to teardown), worker and start time to FILE.cpu: which tests wait and which
    compute, and which ran beside which."""
    path = os.environ.get("_MAESTER_TEST_TIMES")
    if not path:
        yield
        return
    import resource
    import time

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    cpu0, wall0, start = cpu(), time.monotonic(), time.time()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
    with open(path + ".cpu", "a") as f:
        f.write(f"{cpu() - cpu0:.1f}\t{time.monotonic() - wall0:.1f}\t{item.nodeid}\t{worker}\t{start:.0f}\n")


def pytest_runtest_logreport(report):
    """With _MAESTER_TEST_TIMES=FILE, each test's seconds are appended to FILE as it ends, and a failure's report to
    FILE.failures (a long run's slowest tests and failures can be read while it goes on; --durations and the
    failures' tracebacks come only at the end)."""
    path = os.environ.get("_MAESTER_TEST_TIMES")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") is None and hasattr(report, "node"):
        return  # under xdist, the worker writes (the controller gets each report again)
    if report.when == "call" or report.duration > 1:
        with open(path, "a") as f:
            f.write(f"{report.duration:.1f}\t{report.when}\t{report.outcome}\t{report.nodeid}\n")
    if report.failed:
        with open(path + ".failures", "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which the GPU check's bare Python lacks
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than the usable CPUs. The suite's tests wait for a good part of their time (for a
    SLURM job to start, a kill to land, a peer to time out): a cold run with one worker per CPU kept the 2 CPUs of
    the machine 79% busy, with one more 84%; two more spent more CPU and took longer."""
    from maester.cpus import usable_cpus

    return usable_cpus() + 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """The default distribution (`-n` alone): whole modules, the longest first (tests/scheduling.py)."""
    if config.getvalue("dist") == "load":
        from tests.scheduling import LongestFirst

        return LongestFirst(config, log)
    return None


def pytest_terminal_summary(terminalreporter):
    from tests.combinations.summary import matrix_summary

    matrix_summary(terminalreporter)
