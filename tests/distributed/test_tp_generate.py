"""Tensor-parallel generation over two gloo processes gives the tokens of one process: an untied Llama head and a
tied Qwen 3 head with per-head QK-norm, one prompt at a time and as a left-padded batch."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from maester.tools.generate import load_for_inference
from maester.tools.sampling import sample
from tests.helpers import REPO, clean_env, seed_job

TEXTS = ["the model reads", "a token", "the optimizer updates every weight of the network", "so"]


def test_two_processes_generate_what_one_does(corpus, tmp_path):
    jobs = [seed_job(corpus, tmp_path / "jobs", "llama"),
            seed_job(corpus, tmp_path / "jobs", "qwen3", model__name="qwen3",
                     model__overrides='{"tie_embeddings": true}')]
    expected = {}
    for job in jobs:
        model, tokenizer, _ = load_for_inference(job, torch.device("cpu"))
        prompts = [tokenizer.encode(t) for t in TEXTS]
        (job / "prompts.json").write_text(json.dumps(prompts))
        expected[str(job)] = ([sample(model, p, 8) for p in prompts],
                              sample(model, prompts[0], 8, temperature=1.0, seed=5))
        assert len({tuple(out) for out in expected[str(job)][0]}) > 1  # the prompts lead to different tokens
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(REPO / "tests" / "distributed" / "tp_generate.py"), str(tmp_path), *map(str, jobs)],
                         env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=180)
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
