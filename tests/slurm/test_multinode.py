"""Jobs on two SLURM nodes (the `slurm_nodes` cluster of scripts/slurm/local-cluster.sh): each node a slurmd with
its own hostname, /tmp and /dev/shm, on its own loopback address; the job directories on the scratch directory
that both nodes share. Each test is a real sbatch job of `maester submit`'s script: srun starts one torchrun per
node, and they meet at the first node's hostname.

The simulated nodes share one network namespace, so any address reaches any node; what a wrong rendezvous address
would break on a real cluster is refused by `maester.jobs.torchrun` (a loopback endpoint with several nodes)."""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from maester.jobs.slurm import recorded_jobs, submit_job
from maester.tools.job_status import status_items
from maester.train.metrics_file import read_events, read_metrics
from tests.helpers import DEMO_CONFIG, clean_env, run_maester, tiny_overrides, torchrun, write_corpus
from tests.slurm.conftest import FINAL_STATES, SlurmNodes, job_restarts, job_state, wait_for_job
from tests.slurm.test_jobs_on_slurm import wait_until

TIMEOUT = 420
STEPS = 8
# One core of each node per task; a thread per rank on both sides of a comparison (float sums are then the same
# whatever the number of ranks per node); each rank's own log (logs/rank-<R>.log).
RUN = dict(training__steps=STEPS, training__global_batch_size=4, training__micro_batch_size=2,
           training__cpu_threads=1, schedule__warmup_steps=0, checkpoint__interval=2, logging__interval=1,
           logging__per_rank_files="true", slurm__cpus_per_task=1, slurm__signal_seconds=0, slurm__nodes=2)


@pytest.fixture
def scratch(slurm_nodes: SlurmNodes, monkeypatch) -> Path:
    """A directory both nodes see, with a corpus; SLURM_CONF names the two-node cluster for sbatch, scontrol and the
    jobs this test submits. One test at a time has the nodes (pytest-xdist workers wait on a lock): a test kills a
    node, and another counts the processes left on them."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_nodes.conf))
    with open(slurm_nodes.scratch / "tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        root = Path(tempfile.mkdtemp(prefix="test-", dir=slurm_nodes.scratch))
        write_corpus(root / "corpus.parquet")
        yield root
        ids = [r["job_id"] for job in (root / "jobs").glob("*") for r in recorded_jobs(job)]
        if ids:  # a failed test leaves no job behind on the nodes
            subprocess.run(["scancel", *ids], capture_output=True, timeout=60)
            wait_until(lambda: all(job_state(i) in FINAL_STATES for i in ids), 120)
        shutil.rmtree(root, ignore_errors=True)


def new_job(root: Path, name: str, **extra) -> Path:
    """`maester submit --no-submit` of the tiny run as job `name` (not yet submitted)."""
    out = run_maester(["submit", "--no-submit", str(DEMO_CONFIG),
                       *tiny_overrides(root / "corpus.parquet", root / "jobs", name, **{**RUN, **extra})], root)
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "jobs" / name


def submit(job: Path, monkeypatch, **env: str) -> str:
    """Submit the job's slurm.sh as `maester submit` does (recorded in slurm_jobs.jsonl), with `env` (faults) in the
    environment sbatch passes on; the SLURM job id."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    (job_id,) = submit_job(job)
    return job_id


@pytest.fixture(scope="module")
def two_process_reference(tmp_path_factory) -> dict[int, dict]:
    """The FSDP tests' run as a 2-process torchrun on this machine, uninterrupted: its record of each step (once
    for the module; the corpus is the same in every test)."""
    root = tmp_path_factory.mktemp("reference")
    write_corpus(root / "corpus.parquet")
    job = new_job(root, "reference")
    out = torchrun(2, ["train", str(job)], root)
    assert out.returncode == 0, out.stderr[-3000:]
    return by_step(job)


def losses(job: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(job / "metrics.jsonl")]


def by_step(job: Path) -> dict[int, dict]:
    """The last record of each step (a step logged again after a restart counts as its latest run)."""
    return {r["step"]: r for r in read_metrics(job / "metrics.jsonl")}


def hosts(job: Path) -> list[dict]:
    """The `hosts` events of the job's runs: {hostname: ranks} each."""
    return [e["hosts"] for e in read_events(job) if e["event"] == "hosts"]


def rank_pids(cluster: SlurmNodes, node: str) -> list[int]:
    """The training processes running on `node`: torchrun's workers (`python -u -m maester train JOB`), not the
    processes they fork."""
    def command(pid) -> list[bytes]:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return []

    def parent(pid) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    worker = [b"-u", b"-m", b"maester", b"train"]
    return [pid for pid in cluster.pids(node) if command(pid)[1:5] == worker and command(parent(pid))[1:5] != worker]


def wait_for_line(job: Path, job_id: str, text: str, log: str = "train.log") -> None:
    """Until `text` is in the job's log `log`; fails at once when the SLURM job ends first (a test that fails
    fails quickly)."""
    path = job / "logs" / log

    def seen() -> bool:
        if path.is_file() and text in path.read_text():
            return True
        assert job_state(job_id) not in FINAL_STATES, \
            f"job {job_id} ended ({job_state(job_id)}) before {text!r}:\n{errors(job, job_id)[-3000:]}"
        return False

    assert wait_until(seen, TIMEOUT), f"{path}: {text!r} not seen in {TIMEOUT} s"


def errors(job: Path, job_id: str) -> str:
    return (job / "logs" / f"{job_id}.err").read_text()


def test_fsdp_on_two_nodes_stops_at_the_time_limit_and_survives_a_killed_rank(scratch, slurm_nodes, monkeypatch,
                                                                             two_process_reference):
    """FSDP x 2, one rank per node, equal to a 2-process torchrun on one machine, through a walltime stop and a
    rank killed on the second node.

    - The ranks ran on node1 and node2 (each run's `hosts` event; `maester status` shows the nodes). Fault: a
      rendezvous at `localhost` (the launcher refuses it, exit 2) or every rank on one host.
    - The time-limit warning reaches node1's batch shell only (`scancel --batch --signal=USR1`, what
      `--signal=B:USR1@N` sends); its trap touches the stop file, and both nodes' ranks stop after the same step
      (each rank's log says so), with a whole checkpoint; the requeued job resumes bit-identically. Fault: a rank
      that stops on its own view of the request, without agreeing (`StopRequests.agree`): the ranks part ways.
    - A rank on node2 SIGKILLed from outside, with `slurm.max_restarts`: the job requeues itself, resumes from
      `latest` and finishes bit-identical to the uninterrupted run; no traceback in the logs. Fault: no
      max_restarts handling (`maester.jobs.job_end`): the job ends FAILED.
    """
    expected = [r["loss"] for r in two_process_reference.values()]
    job = new_job(scratch, "fsdp", slurm__max_restarts=1)
    go_on = scratch / "go-on"
    # Rank 0 stands still after step 3 (for the warning) and after step 6 (for the kill) until go-on exists.
    job_id = submit(job, monkeypatch, _MAESTER_FAULT="hang:3@0,hang:6@0", _MAESTER_HANG_UNTIL=str(go_on))
    wait_for_line(job, job_id, "standing still at step 3 ")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=60)
    wait_for_line(job, job_id, "time limit near", f"{job_id}.out")
    go_on.touch()
    assert wait_until(lambda: (job / "requeue-requested").exists() or job_restarts(job_id) > 0, TIMEOUT)
    go_on.unlink()  # the second run stands still at step 6
    for log in (job / "logs" / f"rank-{rank}.log" for rank in (0, 1)):  # logged once requeue-requested is written
        assert wait_until(lambda: "stopped on request (stop-requested) after step 4 of 8" in log.read_text(), 60), \
            log.read_text()[-2000:]
    wait_for_line(job, job_id, "standing still at step 6 ")
    (rank_1,) = rank_pids(slurm_nodes, "node2")
    subprocess.run(["kill", "-KILL", str(rank_1)], check=True)
    go_on.touch()
    assert wait_for_job(job_id, TIMEOUT, restarts=2) == "COMPLETED"
    got = by_step(job)
    assert [got[s]["loss"] for s in range(1, STEPS + 1)] == expected
    assert hosts(job) == [{"node1": [0], "node2": [1]}] * 3
    (restart,) = [r for r in recorded_jobs(job) if r.get("event") == "restart"]
    assert (restart["exit_code"], restart["cause"], restart["rank"], restart["host"], restart["step"]) == \
        (137, "SIGKILL", 1, "node2", 4)
    err = errors(job, job_id)
    assert "Traceback" not in err and "ChildFailedError" not in err and "FAILED" not in err, err[-3000:]
    assert "torchrun on node2: rank 1" in err and "failed with exit code 137 (SIGKILL)" in err
    items = dict(status_items(job))
    assert items["nodes"] == f"2 node(s): node1 (rank 0), node2 (rank 1) (SLURM job {job_id})"
    assert items["slurm"].startswith(f"{job_id} COMPLETED, requeued 1 time(s): time limit at step 4")


def test_hsdp_on_two_nodes_fetches_once_per_node_and_cancel_leaves_nothing_running(scratch, slurm_nodes,
                                                                                      monkeypatch):
    """HSDP replicated across the nodes and sharded within each (2 nodes x 2 ranks) trains as one process does,
    within the FSDP tolerance of tests/distributed/test_layouts.py. Faults: a layout that shards across the nodes
    (the hosts event and the losses).

    Per-node work: the tokenizer is a Hub id, and HF_HOME lies in each node's own /tmp. Local rank 0 of each node
    asks the Hub (a mock Hub on this host) once, under the lock in its node's cache; local rank 1 reads that cache.
    Each node ends with its own snapshot, and the ranks of node2 train with node2's, the only one they can see.
    Faults: every rank asking the Hub (four revision requests, not two), or one node's snapshot path used on the
    other (node2's ranks fail to open it).

    `maester cancel` then ends every step on both nodes, and no process of the job is left on either (read from
    each node's own process namespace). Fault: a process of the job that escapes SLURM's tracking on a node."""
    from maester.tools.convert import write_byte_tokenizer
    from tests.helpers import train_reference
    from tests.hub_server import MockHub

    tokenizer = scratch / "tokenizer"
    tokenizer.mkdir()
    write_byte_tokenizer(tokenizer)
    # 4 ranks x 2 sequences (4 accumulation steps in one process); the vocabulary given, as the plan of `maester
    # submit` on the login node may not fetch the tokenizer
    batch = dict(training__global_batch_size=8, model__overrides__vocab_size=272)
    seed, reference = train_reference(scratch, scratch / "corpus.parquet", **{**RUN, **batch},
                                      tokenizer__kind="hf", tokenizer__path=str(tokenizer))
    expected = losses(reference)
    hub = MockHub()
    try:
        hub.add("org/tok", {f.name: f.read_bytes() for f in tokenizer.iterdir()})
        home = f"/tmp/hf-home-{scratch.name}"  # each node's own
        job = new_job(scratch, "hsdp", slurm__nproc_per_node=2, parallel__dp_replicate=2, parallel__dp_shard=2,
                      tokenizer__kind="hf", tokenizer__path="org/tok", **batch)
        shutil.rmtree(job / "checkpoints")
        shutil.copytree(seed, job / "checkpoints", symlinks=True)
        job_id = submit(job, monkeypatch, _MAESTER_FAULT="hang:4@0", _MAESTER_HANG_SECONDS="600", HF_HOME=home,
                        HF_ENDPOINT=hub.url, NO_PROXY="127.0.0.1", HF_HUB_DISABLE_TELEMETRY="1", HF_TOKEN="")
        wait_for_line(job, job_id, "standing still at step 4 ")
    finally:
        hub.stop()
    assert [r["loss"] for r in read_metrics(job / "metrics.jsonl")] == pytest.approx(expected[:3], rel=1e-5)
    assert hosts(job) == [{"node1": [0, 1], "node2": [2, 3]}]
    assert [p for m, p in hub.requests if p.endswith("/revision/main")] == ["/api/models/org/tok/revision/main"] * 2
    for node in slurm_nodes.nodes:
        (snapshot,) = (slurm_nodes.dir / "nodes" / node / "tmp").glob(f"{Path(home).name}/hub/models--org--tok/"
                                                                       f"snapshots/*")
        assert (snapshot / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes(), node
    assert not Path(home).exists()  # this host's /tmp: not a node's
    status = run_maester(["status", str(job)], scratch, env=clean_env(SLURM_CONF=str(slurm_nodes.conf)))
    assert status.returncode == 0, status.stderr
    assert f"nodes       2 node(s): node1 (ranks 0-1), node2 (ranks 2-3) (SLURM job {job_id})" in status.stdout
    for node in slurm_nodes.nodes:
        assert len(rank_pids(slurm_nodes, node)) == 2, node
    cancelled = run_maester(["cancel", str(job)], scratch, env=clean_env(SLURM_CONF=str(slurm_nodes.conf)))
    assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"cancelled {job_id}", cancelled.stderr
    assert wait_for_job(job_id, TIMEOUT) == "CANCELLED"
    slurmd = {node: [p for p in slurm_nodes.pids(node) if Path(f"/proc/{p}/comm").read_text().strip() == "slurmd"]
              for node in slurm_nodes.nodes}
    assert wait_until(lambda: all(set(slurm_nodes.pids(n)) <= set(slurmd[n]) for n in slurm_nodes.nodes), 60), \
        {n: [Path(f"/proc/{p}/cmdline").read_bytes() for p in slurm_nodes.pids(n) if p not in slurmd[n]]
         for n in slurm_nodes.nodes}


def test_a_lost_node_holds_the_job_until_it_returns_and_the_run_resumes_bit_identically(scratch, slurm_nodes,
                                                                                      monkeypatch,
                                                                                      two_process_reference):
    """node2's slurmd and all its processes killed (`local-cluster.sh kill-node`, a machine that died) while the job
    runs: SLURM declares the node down and requeues the job (`--requeue`), which waits while node2 is down; once
    it is back the job resumes on both nodes from `latest` and ends bit-identical to the uninterrupted run, as one
    SLURM job. Faults: a job SLURM may not requeue (`slurm.requeue = false`: it ends with NODE_FAIL and never
    resumes); the job script's own restart (`slurm.max_restarts`) submitting a second job when SLURM had already
    requeued this one (two runs of one job directory)."""
    expected = two_process_reference
    job = new_job(scratch, "lost", slurm__max_restarts=2)
    go_on = scratch / "go-on"
    job_id = submit(job, monkeypatch, _MAESTER_FAULT="hang:5@0", _MAESTER_HANG_UNTIL=str(go_on))
    try:
        wait_for_line(job, job_id, "standing still at step 5 ")
        killed = slurm_nodes.script("kill-node", "node2")
        assert killed.returncode == 0, killed.stderr
        go_on.touch()
        def requeued() -> bool:
            state = job_state(job_id)
            assert state not in FINAL_STATES, f"job {job_id} ended {state}, not requeued"
            return job_restarts(job_id) >= 1 and state == "PENDING"

        assert wait_until(requeued, TIMEOUT), job_state(job_id)
        time.sleep(10)
        assert job_state(job_id) == "PENDING" and len(hosts(job)) == 1  # no node2, no run
    finally:
        back = slurm_nodes.script("start", "--nodes", "2")
        assert back.returncode == 0, back.stdout + back.stderr
    assert wait_for_job(job_id, TIMEOUT, restarts=1) == "COMPLETED", errors(job, job_id)[-3000:]
    assert {r["job_id"] for r in recorded_jobs(job)} == {job_id}, recorded_jobs(job)
    assert set(map(json.dumps, hosts(job))) == {json.dumps({"node1": [0], "node2": [1]})}
    got = by_step(job)
    assert [got[s]["loss"] for s in range(1, STEPS + 1)] == [expected[s]["loss"] for s in range(1, STEPS + 1)]
