"""The TensorBoard and W&B sinks on real tiny runs: what they hold equals metrics.jsonl, once per step across a
crash and a restart; W&B offline needs no network and keeps one run id; online without a server and a missing
package fail with messages that name the config key."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from maester.train.metrics import read_metrics
from maester.train.sinks import SinkError, scalars, wandb_run_id
from tests.helpers import DEMO_CONFIG, clean_env, run_code, run_maester, tiny_overrides

PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


def sources_with_validation(corpus: Path) -> str:
    return json.dumps([{"path": str(corpus), "validation_fraction": 0.03}])


def metrics_by_step(job: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(job / "metrics.jsonl")}


@contextmanager
def silent_port() -> Iterator[tuple[str, Callable[[], int]]]:
    """A local address that takes connections and never answers them, standing in for the network, and a function
    that counts the connections made to it so far."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.setblocking(False)
    accepted: list[socket.socket] = []

    def connections() -> int:
        while True:
            try:
                accepted.append(server.accept()[0])
            except BlockingIOError:
                return len(accepted)

    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", connections
    finally:
        for conn in accepted:
            conn.close()
        server.close()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path: wandb puts a Unix socket under TMPDIR (at most 107 characters)."""
    path = Path(tempfile.mkdtemp(prefix="wb"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def wandb_env(home: Path, tmp: Path, url: str, **extra: str) -> dict[str, str]:
    """The environment of a process that uses wandb: no WANDB_* or proxy settings of the caller, every wandb and
    home directory under `home`, temporary files under `tmp`, and the W&B server and any proxy at `url`."""
    env = {k: v for k, v in clean_env().items()
           if not k.startswith("WANDB_") and k.lower() not in PROXY_VARIABLES}
    for name in ("HOME", "WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        path = home / name.lower()
        path.mkdir(parents=True, exist_ok=True)
        env[name] = str(path)
    env.update(TMPDIR=str(tmp), WANDB_BASE_URL=url, HTTP_PROXY=url, HTTPS_PROXY=url, http_proxy=url, https_proxy=url)
    env.update(extra)
    return env


def wandb_records(run_file: Path, env: dict[str, str]) -> list[dict]:
    """The records of an offline run's transaction log, read by wandb's own reader (`wandb leet inspect --json`,
    which with error reporting off makes no connection)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                         env={**env, "WANDB_ERROR_REPORTING": "false"}, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def wandb_history(records: list[dict]) -> dict[int, dict]:
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    return {row["_step"]: row for row in rows}


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_holds_the_metrics_once_per_step_across_a_restart(corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = tiny_overrides(corpus, tmp_path / "jobs", "tb", logging__tensorboard__enabled="true",
                               logging__eval_interval=3, data__sources=sources_with_validation(corpus))
    job = tmp_path / "jobs" / "tb"
    # Steps 1-6 with val_loss at 3 and 6 and a checkpoint at 4, then SIGKILL: the training of steps 5 and 6 is lost,
    # their events are on disk.
    killed = run_maester(["train", str(DEMO_CONFIG), *overrides], tmp_path,
                         env=clean_env(_MAESTER_FAULT="after_step:6"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    events = EventAccumulator(str(job / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5, 6]  # written as they were logged
    assert [e.step for e in events.Scalars("val_loss")] == [3, 6]

    # The restart resumes from step 4 and evaluates every 4 steps: val_loss at 8 only. The val_loss of step 6
    # belonged to the lost steps and must be gone, though no later event at step 6 replaces it.
    resumed = run_maester(["train", str(job), "--logging.eval_interval=4"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert len(list((job / "tensorboard").glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(job / "tensorboard"))
    events.Reload()
    metrics = metrics_by_step(job)
    tags = ["loss", "grad_norm", "lr", "lr/decay", "tokens_seen", "tokens_per_second", "data_loading_share"]
    assert set(tags) <= set(events.Tags()["scalars"])
    for tag in tags:
        logged = events.Scalars(tag)
        assert [e.step for e in logged] == list(range(1, 9)), tag
        # TensorBoard stores float32: each value is metrics.jsonl's, rounded to float32.
        assert [e.value for e in logged] == [float(np.float32(metrics[s][tag])) for s in range(1, 9)], tag
    assert [e.value for e in events.Scalars("tokens_seen")] == [128 * s for s in range(1, 9)]  # continued at 5
    val = events.Scalars("val_loss")
    assert [e.step for e in val] == [3, 8]
    assert [e.value for e in val] == [float(np.float32(metrics[s]["val_loss"])) for s in (3, 8)]
    assert "val_perplexity" in events.Tags()["scalars"]


# ---------------------------------------------------------------- Weights & Biases


def test_wandb_offline_run_holds_the_metrics_and_restarts_continue_it(corpus, tmp_path, short_tmp):
    job = tmp_path / "jobs" / "wb"

    def train(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return run_maester(["train", *args], tmp_path, env={**env, **extra})

    with silent_port() as (url, connections):
        env = wandb_env(tmp_path / "home", short_tmp, url)
        # A complete run of 4 steps, with val_loss at 4.
        first = train(str(DEMO_CONFIG), *tiny_overrides(
            corpus, tmp_path / "jobs", "wb", training__steps=4, logging__eval_interval=4,
            data__sources=sources_with_validation(corpus), logging__wandb__enabled="true",
            logging__wandb__mode="offline", logging__wandb__project="sinks", logging__wandb__tags='["tiny"]'))
        assert first.returncode == 0, first.stderr
        run_id = (job / "wandb" / "run-id").read_text().strip()
        runs = sorted((job / "wandb").glob("offline-run-*"))
        assert [r.name.endswith(f"-{run_id}") for r in runs] == [True]
        assert f"wandb sync {runs[0]}" in first.stderr  # where the run is, and how to upload it
        assert "wandb:" not in first.stderr  # W&B's own console output stays off ours
        records = wandb_records(runs[0] / f"run-{run_id}.wandb", env)
        metrics = metrics_by_step(job)
        history = wandb_history(records)
        assert sorted(history) == [1, 2, 3, 4]
        for step, row in history.items():
            for key in ("loss", "grad_norm", "lr", "lr/decay", "tokens_seen", "tokens_per_second"):
                assert row[key] == metrics[step][key], (step, key)
        assert history[4]["val_loss"] == metrics[4]["val_loss"]  # the eval record joins its step's row
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        assert (run["run_id"], run["project"], run["display_name"]) == (run_id, "sinks", "wb")
        assert run["tags"] == ["tiny"]
        assert run["config"]["update"]["training"]["steps"] == 4  # the whole resolved config

        # Raised to 8 steps: the second attempt resumes from step-4 (as a requeue or a crash restart does; the
        # TensorBoard test covers the kill) and finishes.
        last = train(str(job), "--training.steps=8")
        assert last.returncode == 0, last.stderr
        assert (job / "wandb" / "run-id").read_text().strip() == run_id
        runs = sorted((job / "wandb").glob("offline-run-*"))
        assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)  # one run id for both attempts
        history = wandb_history(wandb_records(runs[-1] / f"run-{run_id}.wandb", env))
        assert connections() == 0  # offline: not one connection attempt, to the W&B server or anywhere else

    metrics = metrics_by_step(job)
    assert sorted(history) == [5, 6, 7, 8]  # continues after the checkpoint it resumed from
    assert {s: row["loss"] for s, row in history.items()} == {s: metrics[s]["loss"] for s in range(5, 9)}
    assert history[8]["tokens_seen"] == 8 * 128


@pytest.mark.slow
def test_wandb_project_and_entity_come_from_a_dotenv_file_and_its_secret_stays_out_of_the_job(
        corpus, tmp_path, short_tmp):
    """A `.env` in the working directory sets WANDB_PROJECT, WANDB_ENTITY and WANDB_API_KEY; the environment wins
    over it; none of its values reaches config.json or the run's config."""
    secret = "k" * 40
    (tmp_path / ".env").write_text(f"# W&B\nexport WANDB_API_KEY='{secret}'\nWANDB_PROJECT=from-dotenv\n"
                                   f"WANDB_ENTITY=team-dotenv  # a comment\n")
    with silent_port() as (url, connections):
        env = wandb_env(tmp_path / "home", short_tmp, url)
        runs = {}
        for name, extra in (("dotenv", {}), ("environ", {"WANDB_PROJECT": "from-environ"})):
            out = run_maester(["train", str(DEMO_CONFIG), *tiny_overrides(
                corpus, tmp_path / "jobs", name, training__steps=2, logging__wandb__enabled="true",
                logging__wandb__mode="offline")], tmp_path, env={**env, **extra})
            assert out.returncode == 0, out.stderr
            job = tmp_path / "jobs" / name
            run_id = (job / "wandb" / "run-id").read_text().strip()
            (run_dir,) = (job / "wandb").glob("offline-run-*")
            (runs[name],) = [r["run"] for r in wandb_records(run_dir / f"run-{run_id}.wandb", env)
                             if r["type"] == "run"]
            assert secret not in (job / "config.json").read_text()
            assert secret not in json.dumps(runs[name]["config"])
        assert connections() == 0
    assert (runs["dotenv"]["project"], runs["dotenv"]["entity"]) == ("from-dotenv", "team-dotenv")
    assert runs["environ"]["project"] == "from-environ"


def test_a_bad_dotenv_line_is_an_error_naming_it(tmp_path):
    (tmp_path / ".env").write_text("WANDB_PROJECT=x\nthis is not a setting\n")
    out = run_maester(["train", str(DEMO_CONFIG)], tmp_path)
    assert out.returncode == 2 and f"{tmp_path / '.env'}:2: expected KEY=VALUE" in out.stderr, out.stderr


def test_wandb_online_without_a_reachable_server_fails_with_a_clear_error(tmp_path, short_tmp):
    job_dir = tmp_path / "jobs" / "online"
    with silent_port() as (url, connections):
        env = wandb_env(tmp_path / "home", short_tmp, url, WANDB_API_KEY="0" * 40)
        out = run_code(OPEN_METRICS, [f"--job.dump_dir={tmp_path / 'jobs'}", "--job.name=online",
                                      "--logging.wandb.enabled=true", "--logging.wandb.init_timeout=2"],
                       env=env, timeout=180)
        assert connections() > 0  # it did try the (silent) server
    assert out.returncode == 3, out.stderr
    run_id = (job_dir / "wandb" / "run-id").read_text().strip()
    assert out.stdout.startswith(f"logging.wandb: could not start W&B run {run_id} in online mode: ")
    assert "logging.wandb.mode=offline" in out.stdout
    assert "wandb:" not in out.stderr  # W&B's own console output stays off ours


# ---------------------------------------------------------------- errors and helpers

OPEN_METRICS = """
import sys
from maester.config import load_config
from maester.train.metrics import open_metrics
from maester.train.sinks import SinkError

cfg = load_config(None, sys.argv[1:], environ={})
try:
    open_metrics(cfg, cfg.job_dir).close()
except SinkError as e:
    print(e)
    sys.exit(3)
"""


MISSING_PACKAGES = """
import sys
sys.modules["tensorboard"] = sys.modules["wandb"] = None  # as if neither package were installed
from maester.config import load_config
from maester.train.metrics import open_metrics
from maester.train.sinks import SinkError

for key in ("logging.tensorboard.enabled", "logging.wandb.enabled"):
    cfg = load_config(None, [f"--job.dump_dir={sys.argv[1]}", f"--{key}=true"], environ={})
    try:
        open_metrics(cfg, cfg.job_dir).close()
    except SinkError as e:
        print(e)
"""


def test_a_missing_package_is_an_error_naming_the_key_and_the_extra(tmp_path):
    out = run_code(MISSING_PACKAGES, [str(tmp_path)], timeout=120)
    assert out.returncode == 0, out.stderr
    tensorboard, wandb = out.stdout.splitlines()
    assert tensorboard.startswith("logging.tensorboard.enabled is true, but TensorBoard cannot be imported (")
    assert tensorboard.endswith(": pip install 'maester[tensorboard]'")
    assert wandb.startswith("logging.wandb.enabled is true, but wandb cannot be imported (")
    assert wandb.endswith(": pip install 'maester[wandb]'")
    assert not (tmp_path / "demo").exists()  # nothing was opened


def test_wandb_run_id_is_made_once_and_read_back(tmp_path):
    first = wandb_run_id(tmp_path)
    assert len(first) == 8 and first.isalnum() and first == first.lower()
    assert (tmp_path / "wandb" / "run-id").read_text() == first + "\n"
    assert wandb_run_id(tmp_path) == first
    assert wandb_run_id(tmp_path / "other") != first
    (tmp_path / "wandb" / "run-id").write_text("my-run_1\n")  # an id written by hand: continue that run
    assert wandb_run_id(tmp_path) == "my-run_1"
    (tmp_path / "wandb" / "run-id").write_text("not/an id")
    with pytest.raises(SinkError, match=r"wandb/run-id: 'not/an id' is not a W&B run id"):
        wandb_run_id(tmp_path)


def test_scalars_keep_the_finite_numbers_of_a_record():
    record = {"step": 3, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3, "mfu": None,
              "tokens_seen": 384, "flag": True, "name": "x", "val_loss": -float("inf"), "lr/decay": 0.0}
    assert scalars(record) == {"lr": 1e-3, "tokens_seen": 384, "lr/decay": 0.0}
