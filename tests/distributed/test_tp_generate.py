"""Tensor-parallel generation over two gloo processes gives the tokens of one process: an untied Llama head, a
tied Qwen 3 head with per-head QK-norm and an OLMoE mixture of experts, one prompt at a time and as a left-padded
batch."""

from __future__ import annotations

import json

import pytest
import torch

from maester.tools.generate import load_for_inference
from maester.models.sampling import sample
from tests.helpers import REPO, run_maester, seed_job, torchrun

TEXTS = ["the model reads", "a token", "the optimizer updates every weight of the network", "so"]


def test_two_processes_generate_what_one_does(corpus, tmp_path):
    jobs = [seed_job(corpus, tmp_path / "jobs", "llama"),
            seed_job(corpus, tmp_path / "jobs", "qwen3", model__name="qwen3",
                     model__overrides='{"tie_embeddings": true}'),
            seed_job(corpus, tmp_path / "jobs", "olmoe", model__name="olmoe")]  # experts' hidden units split
    expected = {}
    for job in jobs:
        model, tokenizer, _ = load_for_inference(job, torch.device("cpu"))
        prompts = [tokenizer.encode(t) for t in TEXTS]
        (job / "prompts.json").write_text(json.dumps(prompts))
        expected[str(job)] = ([sample(model, p, 8) for p in prompts],
                              sample(model, prompts[0], 8, temperature=1.0, seed=5))
        assert len({tuple(out) for out in expected[str(job)][0]}) > 1  # the prompts lead to different tokens
    out = torchrun(2, [str(tmp_path), *map(str, jobs)], tmp_path, timeout=180,
                   script=REPO / "tests" / "distributed" / "tp_generate.py")
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert result["world"] == 2
        for job, (greedy, sampled) in expected.items():
            got = result["jobs"][job]
            assert got["sharded"] and got["dtype"] == "torch.float32"  # auto on CPU
            assert got["one_at_a_time"] == greedy
            assert got["batched"] == greedy
            assert got["sampled"] == sampled


def test_torchrun_generate_prints_what_one_process_prints(corpus, tmp_path):
    """The command as a user runs it: only rank 0 prints, and it prints the single process's results. The byte
    tokenizer's own vocabulary (269, split unevenly over the two processes): a random model picks padding ids too,
    which the byte tokenizer refuses to decode."""
    job = seed_job(corpus, tmp_path / "jobs", "llama", model__overrides='{"vocab_size": 269}')
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(TEXTS) + "\n")
    args = ["generate", str(job), "--prompts-file", str(prompts), "--max-new-tokens", "8", "--device", "cpu"]
    one = run_maester(args, tmp_path)
    two = torchrun(2, args, tmp_path)
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert two.stdout == one.stdout and one.stdout.count("### ") == len(TEXTS)


def test_under_torchrun_each_process_takes_its_own_gpu(monkeypatch):
    from maester.tools.generate import start_inference

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--device cuda:1 names one GPU, but torchrun started 2 processes"):
        start_inference("cuda:1", "auto")
