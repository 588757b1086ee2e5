"""`tests.forks`: which commands fork from the worker's zygote and which must be real processes."""

from __future__ import annotations

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
