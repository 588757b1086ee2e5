"""The plan's per-rank peak (fake tensors in a fake process group) against the peak torch's memory trackers count
around a real step on real tensors: the demo and the tiny OLMoE in this process, FSDP x2 and TP x2 on two real
gloo processes (tests/plan/measure_ranks.py, started as torchrun starts it). Each within 10%."""

from __future__ import annotations

import json

import pytest
import torch

from maester.config import load_config
from maester.plan.memory import measure_rank_memory, predict_rank_memory
from tests.helpers import DEMO_CONFIG, REPO, clean_env, torchrun

CPU = ["--training.device=cpu", "--training.micro_batch_size=4", "--training.global_batch_size=8"]
ONE_PROCESS = {
    "demo": [],
    "olmoe": ["--model.name=olmoe", "--model.flavor=tiny", "--data.seq_len=128"],
}
TWO_PROCESSES = {
    "fsdp2": ["--parallel.dp_shard=2"],
    "tp2": ["--parallel.tp=2", "--parallel.dp_shard=1"],
}


def _config(overrides: list[str]):
    return load_config(DEMO_CONFIG, CPU + overrides, environ={})


@pytest.mark.parametrize("name", ONE_PROCESS)
def test_predicted_peak_of_one_process_within_10_percent(name):
    cfg = _config(ONE_PROCESS[name])
    predicted = predict_rank_memory(cfg, 1, 0, "cpu")
    torch.manual_seed(0)
    measured = measure_rank_memory(cfg, torch.device("cpu"))
    assert measured.peak > 0
    assert abs(predicted.peak / measured.peak - 1) < 0.10, (predicted, measured)


def test_predicted_peak_of_two_ranks_within_10_percent(tmp_path):
    layouts = [f"{name}={','.join(CPU + overrides)}" for name, overrides in TWO_PROCESSES.items()]
    result = torchrun(2, [str(tmp_path), str(DEMO_CONFIG), *layouts], REPO, env=clean_env(OMP_NUM_THREADS="1"),
                      script=REPO / "tests/plan/measure_ranks.py")
    assert result.returncode == 0, result.stderr[-3000:]
    for name, overrides in TWO_PROCESSES.items():
        cfg = _config(overrides)
        for rank in (0, 1):
            measured = json.loads((tmp_path / f"{name}-rank{rank}.json").read_text())["peak"]
            predicted = predict_rank_memory(cfg, 2, rank, "cpu").to_json()["peak"]
            assert measured > 0
            assert abs(predicted / measured - 1) < 0.10, (name, rank, predicted, measured)
