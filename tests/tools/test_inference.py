"""Inference options of generate and chat on the CPU: the dtype and device chosen, loading in the target dtype
without a float32 copy (peak RSS of a real process), left-padded batches equal to one prompt at a time, streaming."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from maester.parallel.devices import DeviceUnavailable, choose_inference_device
from maester.parallel.precision import inference_dtype
from maester.tools.generate import Completer, Prompt, load_for_inference, read_prompts
from maester.models.sampling import sample, sample_batch
from tests.helpers import REPO, clean_env, run_maester, seed_job

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="shows the CPU side of a GPU choice")
TEXTS = ["the model reads", "a token", "the optimizer updates every weight of the network", "so"]


def test_dtype_follows_the_device_unless_given():
    assert inference_dtype("auto", "cuda") == torch.bfloat16
    assert inference_dtype("auto", "cpu") == torch.float32
    assert inference_dtype("float16", "cpu") == torch.float16 and inference_dtype("float32", "cuda") == torch.float32
    with pytest.raises(ValueError, match="--dtype 'fp8' is not one of auto, float32, bfloat16, float16"):
        inference_dtype("fp8", "cpu")


@no_gpu
def test_a_gpu_asked_for_is_never_the_cpu():
    assert choose_inference_device("auto", env={}) == torch.device("cpu")
    assert choose_inference_device("cpu", env={"CUDA_VISIBLE_DEVICES": "0"}) == torch.device("cpu")
    for choice in ("cuda", "cuda:1"):
        with pytest.raises(DeviceUnavailable, match=f"--device {choice}, but torch .*(CPU-only build|cannot use)"):
            choose_inference_device(choice, env={})
    with pytest.raises(DeviceUnavailable, match="CUDA_VISIBLE_DEVICES=0.*pass --device cpu"):
        choose_inference_device("auto", env={"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(ValueError, match="--device 'gpu' is not one of auto, cpu, cuda, cuda:N"):
        choose_inference_device("gpu", env={})


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Randomly initialised tiny models (varied greedy outputs): a Llama, and a Gemma 3 whose sliding window (4
    tokens) is shorter than the prompts. Their vocabulary is the byte tokenizer's own (269, not rounded up to 320):
    a random model picks the padding ids too, which the byte tokenizer refuses to decode."""
    from tests.helpers import write_corpus

    root = tmp_path_factory.mktemp("inference")
    corpus = write_corpus(root / "corpus.parquet")
    return {"llama": seed_job(corpus, root / "jobs", "llama", model__overrides='{"vocab_size": 269}'),
            "gemma3": seed_job(corpus, root / "jobs", "gemma3", model__name="gemma3",
                               model__overrides='{"n_layers": 2, "sliding_window": 4, "vocab_size": 269}')}


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_a_left_padded_batch_gives_each_prompt_its_own_tokens(jobs, name):
    model, tokenizer, _ = load_for_inference(jobs[name], torch.device("cpu"))
    prompts = [tokenizer.encode(t) for t in TEXTS]
    alone = [sample(model, p, 10) for p in prompts]
    assert len({tuple(out) for out in alone}) == len(prompts)  # different prompts, different tokens
    assert sample_batch(model, prompts, 10) == alone
    assert sample_batch(model, prompts, 10, temperature=1.0, top_k=50, seed=3) == \
        [sample(model, p, 10, temperature=1.0, top_k=50, seed=3) for p in prompts]
    # Each row stops on its own: the first prompt's second token ends it there, the others run on.
    stop = {alone[0][1]}
    assert sample_batch(model, prompts, 10, stop_ids=stop)[1:] == [sample(model, p, 10, stop_ids=stop)
                                                                   for p in prompts[1:]]
    assert sample_batch(model, prompts, 10, stop_ids=stop)[0] == alone[0][:1]


def test_streaming_passes_the_answer_token_by_token(jobs):
    model, tokenizer, cfg = load_for_inference(jobs["llama"], torch.device("cpu"))
    streamed: list[int] = []
    out = sample(model, tokenizer.encode("the model"), 12, on_token=streamed.append)
    assert len(out) == 12 and streamed == out  # each token as it is chosen
    completer = Completer(model, tokenizer, cfg, max_new_tokens=12)
    pieces: list[str] = []  # a random model's bytes rarely end a character: pieces are held back until they do
    text = completer.stream(Prompt("test", text="the model"), pieces.append)
    assert pieces and "".join(pieces) == text == completer.complete(Prompt("test", text="the model"))


def test_the_shipped_smoke_suite_is_batched_like_one_at_a_time(jobs, tmp_path, capsys):
    from maester.cli.tools import print_results

    suite = REPO / "configs" / "prompts" / "smoke.jsonl"
    prompts = read_prompts(suite)
    chats = sum(p.messages is not None for p in prompts)
    assert len(prompts) >= 20 and 5 <= chats < len(prompts)
    model, tokenizer, cfg = load_for_inference(jobs["llama"], torch.device("cpu"))
    completer = Completer(model, tokenizer, cfg, max_new_tokens=6)
    outs = completer.complete_batch(prompts, 8)
    assert outs == completer.complete_batch(prompts, 1) and len(set(outs)) > len(outs) // 2
    print_results(prompts, outs)
    expected = capsys.readouterr().out
    run = run_maester(["generate", str(jobs["llama"]), "--prompts-file", str(suite), "--max-new-tokens", "6"],
                      tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected and run.stdout.count("### ") == len(prompts)


def test_weights_load_in_the_target_dtype_without_a_float32_copy(tmp_path):
    """A 25M-parameter model (100 MB in float32) loaded in a fresh process: in float32 its peak RSS grows by the
    whole model (so the measure can tell), in bfloat16 by well under that."""
    from tests.helpers import write_corpus

    job = seed_job(write_corpus(tmp_path / "corpus.parquet"), tmp_path / "jobs", "big",
                   model__overrides='{"dim": 512, "n_layers": 8, "ffn_hidden_dim": 1536}')
    runs = {}
    for dtype in ("float32", "bfloat16"):
        out = subprocess.run([sys.executable, str(REPO / "tests" / "tools" / "rss_load.py"), str(job), dtype],
                             env=clean_env(), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[dtype] = json.loads(out.stdout.splitlines()[-1])
    fp32 = runs["float32"]["param_bytes"]
    assert runs["bfloat16"]["dtypes"] == ["torch.bfloat16"] and runs["bfloat16"]["param_bytes"] * 2 == fp32
    assert runs["float32"]["peak_growth"] > 0.9 * fp32
    assert runs["bfloat16"]["peak_growth"] < 0.75 * fp32


@no_gpu
def test_generate_on_an_absent_gpu_fails_before_loading(jobs, tmp_path):
    out = run_maester(["generate", str(jobs["llama"]), "--prompt", "the", "--device", "cuda"], tmp_path)
    assert out.returncode == 2 and "--device cuda, but torch" in out.stderr and out.stdout == ""


def test_generate_in_bfloat16_on_the_cpu(jobs, tmp_path):
    out = run_maester(["generate", str(jobs["llama"]), "--prompt", "the model", "--max-new-tokens", "8",
                       "--dtype", "bfloat16"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("the model") and len(out.stdout) > len("the model\n")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_generation_defaults_to_bfloat16(jobs, tmp_path):  # pragma: no cover - GPU check
    from maester.tools.generate import start_inference

    device, dtype, mesh, rank = start_inference("auto", "auto")
    assert (device, dtype, mesh, rank) == (torch.device("cuda", 0), torch.bfloat16, None, 0)
    model, tokenizer, _ = load_for_inference(jobs["llama"], device, dtype)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cuda", torch.bfloat16)}
    assert torch.cuda.max_memory_allocated() < 2 * sum(p.numel() * 2 for p in model.parameters()) + 2**24
    prompts = [tokenizer.encode(t) for t in TEXTS]
    assert len(sample_batch(model, prompts, 8)) == len(prompts)
    out = run_maester(["generate", str(jobs["llama"]), "--prompt", "the model", "--max-new-tokens", "8",
                       "--device", "cuda:0"], tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("the model"), out.stderr
