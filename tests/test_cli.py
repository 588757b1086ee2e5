"""The `maester` command, run as a real subprocess (`python -m maester`) in a temporary directory; the commands that
import torch as forks of a process that imported it (`forked_maester`)."""

from __future__ import annotations

import json
import shlex
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import yaml

from maester.config import Config, load_config
from maester.jobs.job_dir import write_job_dir
from tests.helpers import run_maester

DEMO = Path(__file__).parents[1] / "configs" / "demo.toml"
# The demo warms up for 30 steps; a run of 7 steps needs a shorter warmup (warmup > steps is an error).
SHORT = ["--training.steps", "7", "--schedule.warmup_steps=2"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MAESTER_")}


def maester(*args: str, cwd: Path, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *python_flags, "-m", "maester", *map(str, args)], cwd=cwd, env=_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)


def forked_maester(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`maester ARGS` for a command that imports torch: forked from a process that imported it
    (`helpers.run_maester`); the real entry point is the one above."""
    return run_maester(list(map(str, args)), cwd, _env(), timeout=120)


# ---------------------------------------------------------------- help and import cost


def _imported(stderr: str) -> list[str]:
    """Module names from `python -X importtime` output."""
    return [line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")]


def test_help_is_fast_and_does_not_import_torch(tmp_path):
    start = time.perf_counter()
    result = maester("--help", cwd=tmp_path)
    wall = time.perf_counter() - start
    print(f"maester --help: {wall:.3f} s")
    assert result.returncode == 0, result.stderr
    for command in ("train", "submit", "config", "generate", "eval", "plot"):
        assert command in result.stdout
    assert wall < 2.0

    traced = maester("--help", cwd=tmp_path, python_flags=("-X", "importtime"))
    assert traced.returncode == 0, traced.stderr
    imported = _imported(traced.stderr)
    assert "maester.cli" in imported  # the trace really covers the command
    torch_lines = [line for line in traced.stderr.splitlines() if " torch" in line]
    assert not [m for m in imported if m.split(".")[0] == "torch"], torch_lines
    assert not torch_lines
    assert not [m for m in imported if m.split(".")[0] in ("lm_eval", "datasets", "transformers")]


def test_subcommand_help_exits_0(tmp_path):
    for args in (["submit", "--help"], ["config", "show", "--help"]):
        result = maester(*args, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "--section.key=value" in result.stdout


# ---------------------------------------------------------------- config show


def test_config_show_json_with_override(tmp_path):
    result = maester("config", "show", DEMO, *SHORT, cwd=tmp_path, python_flags=("-X", "importtime"))
    assert result.returncode == 0, result.stderr
    imported = _imported(result.stderr)  # validating a config needs no torch either
    assert "maester.config" in imported and "maester.models.registry" in imported
    assert not [m for m in imported if m.split(".")[0] == "torch"]
    shown = json.loads(result.stdout)
    assert shown["training"]["steps"] == 7
    assert shown["schedule"]["warmup_steps"] == 2
    assert shown["data"]["seq_len"] == 256  # from the file
    assert Config.model_validate(shown) == load_config(DEMO, SHORT, environ={})


def test_config_show_yaml(tmp_path):
    result = maester("config", "show", DEMO, "--format", "yaml", "--training.steps=70", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = yaml.safe_load(result.stdout)
    assert shown["training"]["steps"] == 70
    assert Config.model_validate(shown) == load_config(DEMO, ["--training.steps=70"], environ={})


def test_config_show_missing_file(tmp_path):
    result = maester("config", "show", "missing.toml", cwd=tmp_path)
    assert result.returncode == 2
    assert "missing.toml" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_config_show_bad_value(tmp_path):
    result = maester("config", "show", DEMO, "--training.steps=abc", cwd=tmp_path)
    assert result.returncode == 2
    assert "training.steps" in result.stderr and "'abc'" in result.stderr
    assert "command line --training.steps" in result.stderr


def test_unknown_override_exits_2_with_suggestion(tmp_path):
    result = maester("submit", "--no-submit", DEMO, "--training.stepz=3", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "training.stepz" in result.stderr and "did you mean 'steps'" in result.stderr
    assert "command line --training.stepz" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_commands_without_overrides_reject_them(tmp_path):
    result = maester("plot", tmp_path, "--training.steps=3", cwd=tmp_path)
    assert result.returncode == 2
    assert "unrecognized arguments" in result.stderr


def test_environment_reaches_the_command(tmp_path):
    env = {**_env(), "MAESTER_TRAINING__SEED": "11"}
    result = subprocess.run([sys.executable, "-m", "maester", "config", "show", str(DEMO), "--training.steps=70"],
                            cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert (shown["training"]["seed"], shown["training"]["steps"]) == (11, 70)


# ---------------------------------------------------------------- submit


def test_submit_creates_the_job_directory(tmp_path):
    dump = tmp_path / "dump"
    result = forked_maester("submit", "--no-submit", DEMO, "--name", "myjob", "--job.dump_dir", dump, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    job = dump / "myjob"
    assert (job / "config.json").is_file()
    assert (job / "slurm.sh").is_file()
    assert (job / "logs").is_dir()
    assert (job / "checkpoints").is_dir()
    assert sorted(p.name for p in job.iterdir()) == ["checkpoints", "config.json", "logs", "slurm.sh"]
    assert str(job) in result.stdout

    expected = load_config(DEMO, ["--job.dump_dir", str(dump), "--job.name=myjob"], environ={})
    saved = Config.from_json_file(job / "config.json")
    assert saved == expected
    assert saved.job.name == "myjob" and saved.job.dump_dir == str(dump)
    assert (job / "config.json").read_text() == expected.to_json()

    script = (job / "slurm.sh").read_text()
    assert os.access(job / "slurm.sh", os.X_OK)
    assert "--job-name=myjob" in script
    assert f"JOB_DIR={shlex.quote(str(job.resolve()))}\n" in script
    assert '-m maester train "$JOB_DIR"' in script


def test_job_directory_can_be_shown(tmp_path):
    dump = tmp_path / "dump"
    write_job_dir(load_config(DEMO, ["--job.name=j2", f"--job.dump_dir={dump}"], environ={}))
    result = maester("config", "show", dump / "j2", "--training.steps=70", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["training"]["steps"] == 70 and shown["job"]["name"] == "j2"
    # Showing does not rewrite the saved config.
    demo_steps = tomllib.loads(DEMO.read_text())["training"]["steps"]
    assert Config.from_json_file(dump / "j2" / "config.json").training.steps == demo_steps


def test_submit_dry_run_writes_nothing(tmp_path):
    dump = tmp_path / "dump"
    result = maester("submit", "--no-submit", DEMO, "--name", "myjob", "--job.dump_dir", dump, "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not dump.exists()
    assert list(tmp_path.iterdir()) == []
    expected = load_config(DEMO, ["--job.dump_dir", str(dump), "--job.name=myjob"], environ={})
    assert Config.model_validate_json(result.stdout) == expected
    assert "dry run" in result.stderr and str(dump / "myjob") in result.stderr


def test_submit_default_dump_dir_is_relative_to_cwd(tmp_path):
    result = forked_maester("submit", "--no-submit", DEMO, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "jobs" / "demo" / "config.json").is_file()


def test_submit_rejects_bad_name(tmp_path):
    result = maester("submit", "--no-submit", DEMO, "--name", "a/b", cwd=tmp_path)
    assert result.returncode == 2
    assert "job.name 'a/b'" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_mup_with_a_tied_head_is_one_line(tmp_path):
    """μP's zero-initialised readout with tied embeddings: the project's one-line error, not pydantic's report."""
    result = forked_maester("train", DEMO, f"--job.dump_dir={tmp_path}/jobs", "--mup.enabled=true",
                            "--mup.base_width=64", "--mup.zero_init_readout=true",
                            "--model.overrides.tie_embeddings=true", "--training.steps=2",
                            "--schedule.warmup_steps=1", "--training.device=cpu", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == ["maester train: error: mup with model llama/demo: mup.zero_init_readout needs an untied "
                      "output layer (tie_embeddings is set: the head is the embedding matrix, which cannot start at "
                      "zero)"]
    assert "pydantic" not in result.stderr and "Traceback" not in result.stderr


def test_invalid_utf8_in_a_loader_worker_is_one_line(tmp_path):
    """A bad record met in a DataLoader worker: the record's own message, not DataLoader's wrapped report."""
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"text": "a fine document"}\n{"text": "\xff\xfe"}\n')
    result = forked_maester("train", DEMO, f"--job.dump_dir={tmp_path}/jobs", "--model.flavor=tiny",
                            f'--data.sources=[{{"path": "{data}"}}]', "--training.steps=2",
                            "--schedule.warmup_steps=1", "--training.device=cpu", "--data.num_workers=1", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line or "Traceback" in line]
    assert errors == [f"maester train: error: {data}:2: not valid UTF-8 (byte 10 of the line)"]
