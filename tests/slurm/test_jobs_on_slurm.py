"""Jobs on a real SLURM (the local cluster of scripts/slurm/local-cluster.sh): submit, sweeps, chains,
preemption with requeue, cancel and retry. Each job is the tiny model on CPU."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from maester.jobs.slurm import recorded_jobs
from maester.tools.job_status import status_items
from maester.train.metrics_file import read_metrics
from tests.helpers import DEMO_CONFIG, clean_env, run_maester, tiny_overrides
from tests.slurm.conftest import job_state, wait_for_job

pytestmark = pytest.mark.usefixtures("slurm_cluster")
TIMEOUT = 300
# A CPU job on the local cluster: one core, no GPUs, SLURM's warning off unless a test sets it.
CPU_JOB = dict(slurm__cpus_per_task=1, slurm__signal_seconds=0, logging__interval=1, checkpoint__interval=2,
               schedule__warmup_steps=0, training__device="cpu")


def losses(job: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(job / "metrics.jsonl")]


def submit(tmp_path, name, *args, env: dict | None = None, **extra) -> Path:
    """Submit the tiny run as job `name`; `env`: the environment sbatch passes on to the job (fault injection)."""
    out = run_maester(["submit", str(DEMO_CONFIG), *tiny_overrides(tmp_path / "corpus.parquet", tmp_path / "jobs",
                                                                  name, **{**CPU_JOB, **extra}), *args], tmp_path,
                      env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp_path / "jobs" / name


def reference(tmp_path, steps: int, **extra) -> list[float]:
    """The same run without SLURM, uninterrupted."""
    out = run_maester(["train", str(DEMO_CONFIG), *tiny_overrides(
        tmp_path / "corpus.parquet", tmp_path / "local", "ref", training__steps=steps, **{**CPU_JOB, **extra})],
        tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return losses(tmp_path / "local" / "ref")


@pytest.fixture
def corpus_here(tmp_path):
    from tests.helpers import write_corpus

    write_corpus(tmp_path / "corpus.parquet")
    return tmp_path


def wait_until(done, timeout: float = TIMEOUT) -> bool:
    """Poll `done()` every 0.2 s until it is true (True) or `timeout` seconds have passed (False)."""
    deadline = time.time() + timeout
    while not done():
        if time.time() > deadline:
            return False
        time.sleep(0.2)
    return True


def wait_for_step(job: Path, step: int, timeout: float = TIMEOUT) -> None:
    metrics = job / "metrics.jsonl"
    if not wait_until(lambda: metrics.is_file() and any(r.get("step", 0) >= step for r in read_metrics(metrics)),
                      timeout):
        raise TimeoutError(f"{job} did not reach step {step} in {timeout} s")


def wait_for_text(path: Path, text: str, timeout: float = TIMEOUT) -> None:
    """Until `text` is in the file at `path` (a log the job appends to)."""
    if not wait_until(lambda: path.is_file() and text in path.read_text(), timeout):
        tail = path.read_text()[-3000:] if path.is_file() else "(no such file)"
        raise TimeoutError(f"{path}: {text!r} not seen in {timeout} s; it ends:\n{tail}")


def standing_still(step: int) -> str:
    """The line of the `hang` fault (`maester.train.faults`) at `step`: the run waits for the test."""
    return f"standing still at step {step} "


def test_a_submitted_job_completes_with_its_metrics(corpus_here):
    job = submit(corpus_here, "demo", training__steps=4)
    (record,) = recorded_jobs(job)
    assert wait_for_job(record["job_id"], TIMEOUT) == "COMPLETED"
    assert [r["step"] for r in read_metrics(job / "metrics.jsonl")] == [1, 2, 3, 4]
    assert (job / "logs" / f"{record['job_id']}.out").is_file()
    assert (job / "logs" / "latest.out").resolve() == (job / "logs" / f"{record['job_id']}.out").resolve()
    assert json.loads((job / "COMPLETED").read_text())["step"] == 4


def sweep_file(tmp_path: Path, name: str, body: str, **fixed) -> Path:
    """A sweep over the tiny run on the test corpus; `body` holds its mode and [parameters]."""
    settings = {**CPU_JOB, "model__flavor": "tiny", "data__seq_len": 32, "training__global_batch_size": 4,
                "training__micro_batch_size": 2, "training__device": "cpu", "optimizer__lr": "3e-3", **fixed}
    path, corpus = tmp_path / f"{name}.toml", tmp_path / "corpus.parquet"
    path.write_text(f'name = "{name}"\nbase = "{DEMO_CONFIG}"\n' + body.split("[parameters]")[0] + "[fixed]\n"
                    + "".join(f'"{k.replace("__", ".")}" = "{v}"\n' for k, v in settings.items())
                    + f'"data.sources" = [{{path = "{corpus}"}}]\n'
                    + "[parameters]" + body.split("[parameters]")[1])
    return path


def test_a_sweep_of_three_points_runs_and_reports(corpus_here):
    sweep = sweep_file(corpus_here, "lr", '[parameters]\n"optimizer.lr" = [0.001, 0.003, 0.01]\n',
                       training__steps=3)
    out = run_maester(["sweep", "submit", str(sweep), f"--job.dump_dir={corpus_here / 'jobs'}"], corpus_here)
    assert out.returncode == 0, out.stderr[-3000:]
    root = corpus_here / "jobs" / "lr"
    for point in ("p000", "p001", "p002"):
        assert wait_for_job(recorded_jobs(root / point)[-1]["job_id"], TIMEOUT) == "COMPLETED"
    table = run_maester(["sweep", "status", str(root)], corpus_here)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["job", "slurm", "id", "state", "optimizer.lr", "step", "loss"]
    for line, point, lr in zip(lines[1:], ("p000", "p001", "p002"), ("0.001", "0.003", "0.01")):
        cells = line.split()
        assert cells[0] == point and cells[2] == "COMPLETED" and cells[3] == lr and cells[4] == "3"
        assert float(cells[5]) == pytest.approx(losses(root / point)[-1], abs=1e-4)
    report = run_maester(["sweep", "report", str(root)], corpus_here)
    assert report.returncode == 0, report.stderr
    assert (root / "report.png").stat().st_size > 10_000
    assert len((root / "report.csv").read_text().splitlines()) == 4


def test_a_chain_of_three_jobs_finishes_one_run(corpus_here):
    steps = 16
    expected = reference(corpus_here, steps)
    # The walltime warning of links 1 and 2, while each stands still after its step 3 and 9 (the `hang` fault, until
    # the stop file exists): the script's trap touches this same file. Links 2 and 3 resume past their hang.
    stop_file = corpus_here / "jobs" / "chain" / "stop-requested"
    env = clean_env(_MAESTER_FAULT="hang:3,hang:9", _MAESTER_HANG_UNTIL=str(stop_file), _MAESTER_HANG_SECONDS="300")
    job = submit(corpus_here, "chain", "--chain", "3", env=env, training__steps=steps, slurm__requeue="false")
    links = [r["job_id"] for r in recorded_jobs(job)]
    assert len(links) == 3
    for step in (3, 9):
        wait_for_text(job / "logs" / "train.log", standing_still(step))
        stop_file.touch()
    assert [wait_for_job(j, TIMEOUT) for j in links] == ["COMPLETED"] * 3
    got = {r["step"]: r["loss"] for r in read_metrics(job / "metrics.jsonl")}
    assert max(got) == steps and [got[s] for s in range(1, steps + 1)] == expected
    logs = "".join((job / "logs" / f"{j}.out").read_text() for j in links)
    assert logs.count("requeue") == 0 or "slurm.requeue is off" in logs
    # A stop at the walltime warning is a clean stop: no torchrun traceback, no "FAILED" in the error logs.
    errors = "".join((job / "logs" / f"{j}.err").read_text() for j in links)
    assert "Traceback" not in errors and "ChildFailedError" not in errors and "FAILED" not in errors, errors[-3000:]
    # status: the stopped links as STOPPED, not COMPLETED; the stops, the last checkpoint; quickly
    start = time.perf_counter()
    items = dict(status_items(job))
    assert time.perf_counter() - start < 5
    assert items["slurm"] == (f"{links[0]} STOPPED (link 1 of 3): time limit at step 3, checkpointed (SLURM: "
                              f"COMPLETED), {links[1]} STOPPED (link 2 of 3): time limit at step 9, checkpointed "
                              f"(SLURM: COMPLETED), {links[2]} COMPLETED (link 3 of 3)")
    assert items["stops"].startswith("2 for a time limit") and items["checkpoint"].startswith(f"step-{steps}, ")


@pytest.mark.parametrize("mode,workers", [("pretrain", 0), ("pretrain", 2), ("sft", 2)])
def test_a_preempted_job_requeues_and_ends_with_the_uninterrupted_loss(corpus_here, mode, workers):
    """`scontrol requeue` signals the whole job, loader workers included (data.num_workers > 0): they leave the
    stop to the trainer, which saves; the requeued run waits for the lock and resumes."""
    steps = 20
    extra = {"data__num_workers": workers}
    if mode == "sft":
        from tests.data.test_sft import write_conversations

        write_conversations(corpus_here / "chats.jsonl", 200)
        extra.update(data__mode="sft", data__seq_len=128,
                     data__sources=json.dumps([{"path": str(corpus_here / "chats.jsonl")}]))
    expected = reference(corpus_here, steps, **extra)
    # The requeue's SIGTERM while the run stands still after step 6 (the `hang` fault), released once torchrun
    # has it: the trainer stops with steps to spare, however slow the machine.
    go_on = corpus_here / "go-on"
    env = clean_env(_MAESTER_FAULT="hang:6", _MAESTER_FAULT_ONCE=str(corpus_here / "hung-once"),
                    _MAESTER_HANG_UNTIL=str(go_on), _MAESTER_HANG_SECONDS="300")
    job = submit(corpus_here, "preempted", env=env, training__steps=steps, **extra)
    (record,) = recorded_jobs(job)
    wait_for_text(job / "logs" / "train.log", standing_still(6))
    subprocess.run(["scontrol", "requeue", record["job_id"]], check=True)
    wait_for_text(job / "logs" / f"{record['job_id']}.err", " death signal, shutting down workers")
    go_on.touch()
    assert wait_for_job(record["job_id"], TIMEOUT, restarts=1) == "COMPLETED"
    got = {r["step"]: r["loss"] for r in read_metrics(job / "metrics.jsonl")}
    assert [got[s] for s in range(1, steps + 1)] == expected
    out = (job / "logs" / f"{record['job_id']}.out").read_text()
    assert "restart 1" in out
    assert dict(status_items(job))["slurm"].startswith(f"{record['job_id']} COMPLETED, requeued 1 time(s): SIGTERM "
                                                       f"at step ")
    err = (job / "logs" / f"{record['job_id']}.err").read_text()
    assert "Traceback" not in err and "ChildFailedError" not in err and "FAILED" not in err, err[-3000:]


def test_cancel_and_retry_on_a_failing_point(corpus_here):
    # p000 trains long enough to be cancelled; p001's init_from is a directory but not a checkpoint: it fails.
    sweep = sweep_file(corpus_here, "cr", 'mode = "zip"\n[parameters]\n"training.steps" = [100000, 3]\n'
                       f'"checkpoint.init_from" = ["null", "{corpus_here}"]\n')
    out = run_maester(["sweep", "submit", str(sweep), f"--job.dump_dir={corpus_here / 'jobs'}"], corpus_here)
    assert out.returncode == 0, out.stderr[-3000:]
    root = corpus_here / "jobs" / "cr"
    failing = recorded_jobs(root / "p001")[-1]["job_id"]
    assert wait_for_job(failing, TIMEOUT) == "FAILED"
    wait_for_step(root / "p000", 1)
    cancelled = run_maester(["sweep", "cancel", str(root)], corpus_here)
    assert cancelled.returncode == 0 and recorded_jobs(root / "p000")[-1]["job_id"] in cancelled.stdout
    assert wait_for_job(recorded_jobs(root / "p000")[-1]["job_id"], TIMEOUT) == "CANCELLED"
    retried = run_maester(["sweep", "retry", str(root)], corpus_here)
    assert retried.returncode == 0 and "p000" in retried.stdout and "p001" in retried.stdout
    assert [len(recorded_jobs(root / p)) for p in ("p000", "p001")] == [2, 2]
    assert wait_for_job(recorded_jobs(root / "p001")[-1]["job_id"], TIMEOUT) == "FAILED"
    run_maester(["sweep", "cancel", str(root)], corpus_here)  # do not leave p000 running
    assert job_state(recorded_jobs(root / "p000")[-1]["job_id"]) in ("CANCELLED", "COMPLETING", "PENDING")


def test_a_walltime_stop_with_a_background_write_in_flight_saves_before_the_requeue(corpus_here):
    """checkpoint.async_mode = async: the write of step 4 stalls in its thread (the `slow_write` fault) while training
    goes on; SLURM's walltime warning (USR1 to the batch shell, whose trap asks for a stop) comes at step 5 or so.
    The trainer waits for the write in flight, then saves its own step, and only then asks for the requeue; the
    requeued job resumes from that checkpoint and ends with the uninterrupted losses."""
    from concurrent.futures import ThreadPoolExecutor

    steps = 10
    pool = ThreadPoolExecutor(1)  # the uninterrupted run, beside the SLURM job
    expected = pool.submit(reference, corpus_here, steps)
    go_on = corpus_here / "go-on"
    env = clean_env(_MAESTER_FAULT="slow_write:4", _MAESTER_FAULT_ONCE=str(corpus_here / "stalled-once"),
                    _MAESTER_HANG_UNTIL=str(go_on), _MAESTER_HANG_SECONDS="300")
    job = submit(corpus_here, "walltime", env=env, training__steps=steps, checkpoint__async_mode="async")
    (record,) = recorded_jobs(job)
    wait_for_step(job, 5)
    subprocess.run(["scancel", "--batch", "--signal=USR1", str(record["job_id"])], check=True)
    log = job / "logs" / "train.log"
    wait_for_text(log, "waiting for the background write of step-4")
    assert not (job / "requeue-requested").exists() and (job / "checkpoints" / "step-4.tmp").is_dir()
    # the trap's touch; nothing removes the file while the trainer waits
    assert wait_until(lambda: (job / "stop-requested").exists()), log.read_text()[-3000:]
    go_on.touch()
    assert wait_for_job(record["job_id"], TIMEOUT, restarts=1) == "COMPLETED"
    got = {r["step"]: r["loss"] for r in read_metrics(job / "metrics.jsonl")}
    assert [got[s] for s in range(1, steps + 1)] == expected.result(timeout=TIMEOUT)
    pool.shutdown()
    text = log.read_text()
    stop = text.index("stopped on request (stop-requested) after step ")
    stopped_at = int(text[stop:].split("after step ")[1].split()[0])
    assert text.index("step-4 written in the background") < stop
    assert f"/step-{stopped_at}; wrote " in text[stop:].splitlines()[0]  # the checkpoint of the stop's own step
    assert f"/step-{stopped_at} at step {stopped_at}" in text[stop:]  # where the requeued run resumed
    slurm_out = (job / "logs" / f"{record['job_id']}.out").read_text()
    assert "time limit near" in slurm_out and "checkpoint written: requeueing" in slurm_out
