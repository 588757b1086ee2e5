"""`maester preflight`: collectives checked against analytic results on 2 gloo processes, wrong results and hangs
stopping the job, and the check before training."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from maester.cli import main
from maester.config import ConfigError, load_config
from maester.files import parse_buffer_size
from maester.parallel.precision import DTYPES
from maester.parallel.preflight import (FAULT_ENV, OPS, PreflightFailed, bus_factor, gather_input,
                                    reduce_expected, reduce_input)
from maester.train.trainer import Trainer
from tests.helpers import DEMO_CONFIG, clean_env, tiny_overrides, torchrun

FAST = ["--training.device=cpu", "--preflight.iterations=2"]


def preflight_args(tmp_path, *extra: str) -> list[str]:
    return ["preflight", str(DEMO_CONFIG), f"--job.dump_dir={tmp_path / 'jobs'}", "--job.name=pf", *FAST, *extra]


def read_report(tmp_path) -> dict:
    return json.loads((tmp_path / "jobs" / "pf" / "preflight.json").read_text())


@pytest.mark.parametrize("world", [1, 2, 3, 8, 13])
def test_reduce_inputs_sum_to_the_expected_values_exactly_in_every_dtype(world):
    """The analytic sum is the sum of the inputs, and adding them in bfloat16 or float16 in any order loses nothing."""
    count = 97
    inputs = torch.stack([reduce_input(r, world, 0, count, torch.device("cpu")) for r in range(world)])
    expected = reduce_expected(world, 0, count, torch.device("cpu"))
    assert torch.equal(inputs.sum(0), expected)
    assert (inputs != 0).sum(0).max() <= 8 and inputs.abs().max() <= 2
    assert torch.equal(reduce_expected(world, 40, 20, torch.device("cpu")), expected[40:60])
    order = list(range(world))
    random.Random(world).shuffle(order)
    for dtype in (torch.bfloat16, torch.float16):
        total = torch.zeros(count, dtype=dtype)
        for r in order:
            total += inputs[r].to(dtype)
        assert torch.equal(total.double(), expected.double())


def test_gather_inputs_differ_between_ranks_and_are_exact_in_16_bits():
    chunks = [gather_input(r, 64, torch.device("cpu")) for r in range(300)]
    assert all(not torch.equal(chunks[0], c) for c in chunks[1:251])
    for dtype in (torch.bfloat16, torch.float16):
        assert all(torch.equal(c.to(dtype).long(), c) for c in chunks)


def test_sizes_and_config_are_validated():
    assert [parse_buffer_size(s) for s in ("4096", "64K", "32MiB", "1G")] == [4096, 64 << 10, 32 << 20, 1 << 30]
    with pytest.raises(ValueError, match="'12KB' is not a size"):
        parse_buffer_size("12KB")
    with pytest.raises(ConfigError, match="preflight.sizes: sizes are positive"):
        load_config(None, ["--preflight.sizes=[1024, 0]"], environ={})
    with pytest.raises(ConfigError, match="preflight.dtypes"):
        load_config(None, ["--preflight.dtypes=[\"float64\"]"], environ={})


def test_report_on_two_ranks_is_correct_and_complete(tmp_path):
    run = torchrun(2, preflight_args(tmp_path, "--sizes", "1K", "1002"), tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = read_report(tmp_path)
    assert report["ok"] and report["stopped"] is None
    assert (report["world_size"], report["backend"], report["device"]) == (2, "gloo", "cpu")
    assert len(report["hosts"]) == 2 and report["iterations"] == 2
    results = report["results"]
    assert [(r["op"], r["dtype"], r["size"]) for r in results] == [
        (op, dtype, size) for op in OPS for dtype in DTYPES for size in (1024, 1002)]
    for r in results:
        assert r["ok"] and r["max_error"] == 0, r
        itemsize = DTYPES[r["dtype"]].itemsize
        per_rank = r["size"] // itemsize // (1 if r["op"] == "all_reduce" else 2)
        assert r["bytes"] == per_rank * itemsize * (1 if r["op"] == "all_reduce" else 2), r
        assert r["time_s"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bus_factor(r["op"], 2))
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_gather", 8) == 7 / 8
    table = run.stdout
    assert "2 rank(s) on 1 host(s)" in table and table.count(" ok\n") == 18 and "18 checks, all correct" in table


def test_wrong_result_with_fail_fast_stops_with_status_1(tmp_path):
    run = torchrun(2, preflight_args(tmp_path, "--sizes", "1K", "--fail-fast"), tmp_path,
                   env=clean_env(**{FAULT_ENV: "corrupt:1"}))
    assert run.returncode != 0
    assert "preflight stopped the job: wrong result: all_reduce float32 1 KiB is off by up to 1" in run.stderr
    report = read_report(tmp_path)
    assert not report["ok"] and report["stopped"].startswith("wrong result")
    assert [(r["op"], r["ok"], r["max_error"]) for r in report["results"]] == [("all_reduce", False, 1.0)]


def test_wrong_results_without_fail_fast_are_reported_and_the_status_is_0(tmp_path, monkeypatch, capsys):
    """One process (a process group of one, in this process): the same checks, the same report."""
    monkeypatch.setenv(FAULT_ENV, "corrupt:0")
    main(preflight_args(tmp_path, "--sizes", "1K", "--dtypes", "float16"))  # returns: no SystemExit
    out = capsys.readouterr()
    report = read_report(tmp_path)
    assert report["world_size"] == 1 and not report["ok"] and report["stopped"] is None
    assert [(r["op"], r["ok"], r["max_error"]) for r in report["results"]] == [(op, False, 1.0) for op in OPS]
    assert out.out.count("  WRONG\n") == 3 and "WRONG results" in out.err


def test_hanging_rank_stops_the_job_within_the_timeout(tmp_path):
    start = time.monotonic()
    run = torchrun(2, preflight_args(tmp_path, "--sizes", "1K", "--preflight.timeout_s=2"), tmp_path,
                   env=clean_env(**{FAULT_ENV: "hang:1"}), timeout=900)
    elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert "timeout: all_reduce float32 1 KiB did not finish within 2 s" in run.stderr
    # process start, 2 s, the other rank's grace (78 s seen with a load average of 16); without the
    # watchdog gloo waits 30 minutes
    assert elapsed < 300
    report = read_report(tmp_path)
    assert not report["ok"] and report["results"] == []
    assert report["stopped"] == "timeout: all_reduce float32 1 KiB did not finish within 2 s"


PREFLIGHT_BEFORE_TRAINING = dict(preflight__enabled="true", preflight__sizes="[1024]",
                                 preflight__dtypes='["float32"]', preflight__iterations=2, training__steps=2,
                                 checkpoint__interval=0)


def test_preflight_before_training_then_trains(corpus, tmp_path):
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "pre", **PREFLIGHT_BEFORE_TRAINING),
                      environ={})
    result = Trainer(cfg, cfg.job_dir).train()
    assert result.step == 2
    report = json.loads((cfg.job_dir / "preflight.json").read_text())
    assert report["ok"] and len(report["results"]) == 3
    assert (cfg.job_dir / "metrics.jsonl").is_file()


def test_wrong_result_before_training_stops_the_job_before_any_training(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "corrupt:0")
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "bad", **PREFLIGHT_BEFORE_TRAINING),
                      environ={})
    with pytest.raises(PreflightFailed, match="wrong result: all_reduce float32 1 KiB"):
        Trainer(cfg, cfg.job_dir)
    assert json.loads((cfg.job_dir / "preflight.json").read_text())["stopped"].startswith("wrong result")
    assert not (cfg.job_dir / "metrics.jsonl").exists()
    assert not any((cfg.job_dir / "checkpoints").glob("step-*"))
