"""The benchmark harnesses run (in their CPU smoke mode) and print their table. Those that import torch are forks of
a process that imported it and maester (`helpers.run_python`), each as `python SCRIPT` would run it; the training
throughput harness imports neither (it times `maester train` processes of its own) and the suite timer is real."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO, clean_env, run_python


def test_train_throughput_smoke(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--smoke"],
                         env=clean_env(XDG_CACHE_HOME=str(tmp_path)), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    row = out.stdout.strip().splitlines()[-1].split("|")
    assert row[1].strip() == "smoke (CPU, tiny)"
    assert int(row[3]) == 3 and float(row[4].replace(",", "")) > 0
    assert row[5].strip() == "n/a"  # no MFU on CPU


def test_data_throughput_smoke(tmp_path):
    out = run_python(["--smoke"], script=REPO / "benchmarks" / "data_throughput.py",
                     env=clean_env(XDG_CACHE_HOME=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    names = [r[1].strip() for r in rows[1:]]
    assert names[0].startswith("naive loop") and "tokenize --workers 1" in names[1]
    assert names[-2].startswith("text loader") and names[-1].startswith("indexed loader")
    assert all(float(r[2].replace(",", "")) > 0 for r in rows[1:])
    assert rows[1][3].strip() == "1.00"


def test_generate_smoke(tmp_path):
    out = run_python(["--smoke"], script=REPO / "benchmarks" / "generate.py")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[1].strip() for r in rows[1:]] == ["llama demo", "gemma3 (demo width)"]
    assert all(float(r[5].strip().rstrip("x")) > 1 for r in rows[1:])  # the cache is faster


def test_optimizer_step_smoke():
    out = run_python(["--smoke"], script=REPO / "benchmarks" / "optimizer_step.py")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[1].strip() for r in rows[1:]][0] == "adamw (baseline)" and len(rows) == 7
    assert rows[1][3].strip() == "1.00x" and all(float(r[2]) > 0 for r in rows[1:])


def test_peers_quick(tmp_path):
    """The peers table: our forward + backward against transformers' on the same weights (the harness refuses
    unequal losses) and our trainer against the plain loops, at equal parameter counts."""
    out = run_python(["--quick", "--no-compile"], script=REPO / "benchmarks" / "peers.py",
                     env=clean_env(XDG_CACHE_HOME=str(tmp_path)), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    names = [r[1].strip() for r in rows[1:]]
    assert names[0].startswith("forward + backward") and "loss" in names[0]
    assert "transformers Llama" in names[1] and "transformers GPT-2" in names[2]
    assert all(float(r[4].split("x")[0]) > 0 for r in rows[1:])
    import re

    peer, ours = re.search(r"\(([\d.]+)M parameters; maester ([\d.]+)M\)", names[1]).groups()
    assert ours == peer  # the same architecture, the same count


def test_hot_path_profile():
    out = run_python(["--top", "3", "--quick"], module="benchmarks.hot_path")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    groups = {r[1].strip(): (float(r[2]), float(r[3])) for r in rows if r[1].strip() in ("matmul", "attention")}
    assert groups["matmul"][0] > 0 and groups["attention"][1] > 0 and len(rows) == 1 + 4 + 1 + 3


def test_checkpoint_io_smoke(tmp_path):
    out = run_python(["--smoke", "--dir", str(tmp_path)], script=REPO / "benchmarks" / "checkpoint_io.py",
                     timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    tables = out.stdout.split("\n\n")
    rows = [line.split("|") for line in tables[1].splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[1].strip() for r in rows[1:]] == [
        "raw write, 64 MiB blocks + fsync", "save, off: loop blocked (= the whole save)", "save, off, 2 write threads",
        "save, async: background write", "memory copy of the state, touched buffers", "raw read, cold cache",
        "load at resume, full verification, cold cache", "load, page cache warm, no checksums",
        "load, page cache warm, full verification", "full check alone (verify_checkpoint), warm"]
    ranks = [line.split("|") for line in tables[3].splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[1].strip() for r in ranks[1:]] == ["2"]
    figures = json.loads(out.stdout.split("JSON ", 1)[1])
    assert figures["bytes"] > 1e6 and len(figures["async_blocked_seconds"]) == 1
    assert figures["blocked_ratio"] > 0 and figures["sync_profile"]["torch.save"] > 0
    assert figures["verify_seconds_per_gb"] > 0 and figures["load_vs_raw_read"] > 0  # the table rounds to 1 ms
    assert all(figures[k] > 0 for k in ("load", "load_warm_unverified", "load_warm_verified", "verify_warm"))
    assert min(figures["memory_copy_seconds"] + figures["threads_blocked_seconds"] + figures["raw_write_seconds"]) > 0
    per_rank = figures["per_rank"]["2"]
    assert sorted(per_rank) == ["0", "1"] and all(r["hashed_bytes"] >= r["shard_bytes"] for r in per_rank.values())
    assert list(tmp_path.iterdir()) == []  # its temporary directory is gone


def test_suite_time_counts_the_command_and_the_machine_and_keeps_its_exit_code(tmp_path):
    """The harness behind README's suite times: a command that spins one CPU for a second and exits 3 gives about a
    CPU second of its own, the machine's busy figure counts it too, and the harness exits 3."""
    out = tmp_path / "figures.json"
    spin = "import time, sys\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\nsys.exit(3)"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "suite_time.py"), "--every", "0.2",
                          "--json", str(out), "--", sys.executable, "-c", spin],
                         capture_output=True, text=True, timeout=120, env=clean_env())
    assert run.returncode == 3, run.stderr
    figures = json.loads(out.read_text())
    assert figures["exit_code"] == 3 and figures["wall_s"] >= 1.0, figures
    assert 0.9 <= figures["command_cpu_s"] <= figures["wall_s"] + 1, figures
    assert figures["machine_busy_cpu_s"] >= 0.9 and figures["stretches"] >= 4, figures
    assert "suite time:" in run.stdout


def test_suite_time_writes_whole_minutes_and_the_seconds_left():
    from benchmarks.suite_time import minutes_and_seconds

    assert [minutes_and_seconds(s) for s in (1911.4, 1940.8, 59.6, 0.2)] == [
        "31 min 51 s", "32 min 21 s", "1 min 0 s", "0 min 0 s"]
