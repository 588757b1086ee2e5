"""`tests.forks`: which commands fork from the worker's zygote and which must be real processes."""

from __future__ import annotations

from pathlib import Path

from tests import forks
from tests.helpers import clean_env


def test_inductors_cache_dir_in_the_environment_keeps_commands_forked(monkeypatch):
    """Inductor writes TORCHINDUCTOR_CACHE_DIR into os.environ on first use (importing maester's trainer does it), so
    it is in the environment of a worker's later commands or not depending on what ran before; a command must fork
    either way (it once made every later command of a worker a real interpreter: a hundred in a run)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    before = clean_env()
    cache_dir()
    after = clean_env()
    assert "TORCHINDUCTOR_CACHE_DIR" in after and "TORCHINDUCTOR_CACHE_DIR" not in before
    assert forks._import_time(before) == forks._import_time(after)
    assert forks.zygote_for(before) is not None and forks.zygote_for(after) is not None


def test_a_variable_torch_reads_as_it_loads_makes_the_command_real():
    assert forks.zygote_for(clean_env(MALLOC_ARENA_MAX="2")) is None
    assert forks.zygote_for(clean_env(PYTHONHASHSEED="7")) is None
    assert forks.zygote_for(clean_env(OMP_NUM_THREADS="1")) is not None  # the child sets torch's threads


def test_what_a_library_imported_in_the_worker_sets_keeps_commands_forked(monkeypatch):
    """threadpoolctl (imported with lm-eval's dependencies) sets KMP_DUPLICATE_LIB_OK in os.environ when a test
    imports it in the worker: the commands after it, whose environments copy os.environ, still fork; the same
    variable given to one command alone makes it real."""
    monkeypatch.delitem(forks._STARTING, "KMP_DUPLICATE_LIB_OK", raising=False)
    monkeypatch.delenv("KMP_DUPLICATE_LIB_OK", raising=False)
    assert forks.zygote_for(clean_env()) is not None
    monkeypatch.setenv("KMP_DUPLICATE_LIB_OK", "True")  # what `import threadpoolctl` does
    assert forks.zygote_for(clean_env()) is not None
    assert forks.zygote_for(clean_env(KMP_DUPLICATE_LIB_OK="False")) is None


def test_a_pid_the_kernel_gives_again_is_a_new_command_not_the_one_that_ended():
    """The kernel reuses pids (pid_max is 32768 on many machines, and a run starts tens of thousands of processes
    and threads): the status of an earlier child with the same pid must not end the new one at once (a command
    then read as ended with exit 0 and no output)."""
    import io
    import json
    import threading

    from tests.processes import Zygote

    zygote = Zygote.__new__(Zygote)
    messages = [{"ready": True}, {"id": 0, "pid": 100}, {"pid": 100, "status": 0, "cpu": 0.5}, {"id": 1, "pid": 100}]
    zygote._proc = type("Proc", (), {"stdout": io.StringIO("".join(json.dumps(m) + "\n" for m in messages))})()
    zygote._lock, zygote._pids, zygote._status, zygote._live = threading.Condition(), {}, {}, set()
    zygote.cpu_seconds, zygote._ready = 0.0, False
    zygote._read()
    assert zygote._pids == {0: 100, 1: 100} and zygote.cpu_seconds == 0.5
    assert zygote.status(100) is None and zygote._live == {100}  # the second command still runs


def test_a_forked_script_takes_tmpdir_and_arguments_as_a_new_process_does(tmp_path):
    """The zygote chose its temporary folder when it imported torch: a fork with TMPDIR in its environment uses
    that folder instead, as a new process would (wandb puts its socket there); `python -c CODE ARGS` gets its
    arguments (sys.argv[0] is the file the code was written to), and `python -m MODULE ARGS` sys.argv as python
    gives it."""
    from tests.helpers import REPO, run_code, run_python

    code = "import json, sys, tempfile\nprint(json.dumps([tempfile.gettempdir(), sys.argv[1:]]))"
    assert forks.run_python(["x"], REPO, clean_env(), 60, script=REPO / "tests" / "__init__.py") is not None
    out = run_code(code, ["a", "b c"], env=clean_env(TMPDIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f'["{tmp_path}", ["a", "b c"]]'
    module = run_python(["--help"], module="benchmarks.suite_time")
    assert module.returncode == 0 and module.stdout.startswith("usage: suite_time.py "), module.stderr


def test_every_test_on_the_forkserver_asks_for_its_one_preload():
    """multiprocessing keeps one forkserver per process, with the preload of whoever started it: a test module with a
    preload of its own would decide what every later module's ranks import themselves."""
    import importlib.util

    from tests import forkserver
    from tests.helpers import REPO

    files = {str(p.relative_to(REPO)): p.read_text() for p in (REPO / "tests").rglob("*.py")
             if p.resolve() != Path(__file__).resolve()}
    users = {name for name, text in files.items() if 'start_method="forkserver"' in text}
    assert len(users) >= 5
    own = {name for name, text in files.items() if "set_forkserver_preload(" in text}
    assert own == {"tests/forkserver.py"}, own
    modules = {u[:-3].replace("/", ".") for u in users}
    assert modules <= set(forkserver.PRELOAD), modules - set(forkserver.PRELOAD)
    assert all(importlib.util.find_spec(m) is not None for m in forkserver.PRELOAD)


def test_a_preload_set_elsewhere_in_a_worker_keeps_the_tests_one():
    """maester's data commands set a preload of their own for their worker pool; run in-process by a test before
    the worker's forkserver started, it would have been the server's, for every later test."""
    import multiprocessing
    import multiprocessing.forkserver

    from tests import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(["maester.data.worker_pool", "json"])
    assert multiprocessing.forkserver._forkserver._preload_modules == [
        *forkserver.PRELOAD, "maester.data.worker_pool", "json"]
    forkserver.install()  # once is enough: installing again wraps nothing
    multiprocessing.forkserver.set_forkserver_preload(["json"])
    assert multiprocessing.forkserver._forkserver._preload_modules == [*forkserver.PRELOAD, "json"]
