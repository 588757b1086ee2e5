"""`maester plan`: the shipped GPU configs fit the layout they declare (a config that stops fitting fails here),
Llama 3 8B on 8 H100s agrees with arithmetic written out below, a plan that does not fit names changes that do,
each of which fits when planned again; the memory a run can count on comes from what torch measures of each GPU
kind; background checkpoints' host memory is set beside the node's."""

from __future__ import annotations

import re

import pytest

from maester import exit_codes
from maester.cli import main
from maester.cli.plan import declared_gpu, declared_gpus
from maester.config import load_config
from maester.plan.checkpoint_host import checkpoint_host
from maester.plan.device import device_memory, verdict
from maester.plan.make import make_plan
from maester.plan.memory import GiB
from tests.helpers import DEMO_CONFIG, REPO

# The demo at a micro-batch of 64 x 2048 tokens: 5.9 GiB of activations, planned in seconds
BIG_BATCH = ["--data.seq_len=2048", "--training.global_batch_size=64", "--training.micro_batch_size=64"]
SHIPPED_GPU_CONFIGS = {"llama3/8b.toml", "llama3/8b-sft-long-context.toml", "olmoe/1b-7b.toml", "gemma3/1b-sft.toml"}


def test_every_shipped_gpu_config_fits_its_declared_layout():
    planned = {}
    for path in sorted((REPO / "configs").rglob("*.toml")):
        if path.parent.name == "sweeps":
            continue
        cfg = load_config(path, [], environ={})
        gpus = declared_gpus(cfg)
        if gpus is None:  # a CPU config
            continue
        gpu, source = declared_gpu(cfg)
        plan = make_plan(cfg, gpus, gpu, source=str(path), gpu_from=source, advise=False)
        assert plan.verdict.kind == "fits", f"{path.relative_to(REPO)} on {gpus} x {gpu}: {plan.verdict.line}"
        rows = plan.memory.rows()
        assert rows["parameters"] > 0 and rows["optimizer state"] > 0 and rows["activations"] > 0, rows
        assert plan.throughput.tokens_per_second > 0
        planned[str(path.relative_to(REPO / "configs"))] = plan.peak_gib
    assert set(planned) == SHIPPED_GPU_CONFIGS, planned


def test_llama3_8b_on_8_h100_agrees_with_arithmetic():
    """An estimate independent of the trackers: fp32 parameters, gradients and Adam's two moments sharded over 8;
    the bf16 root (embedding and output) and two blocks gathered; selective-op checkpointing keeps each block's
    input and every matmul's and attention's output, per token and layer; the chunked loss's logits and their
    gradient in fp32 plus the output layer's fp32 gradient. (The second GPU review's arithmetic gives about 48 GiB.)"""
    from maester.plan.table import format_plan

    cfg = load_config(REPO / "configs/llama3/8b.toml", [], environ={})
    plan = make_plan(cfg, 8, "h100", advise=False)

    d, kv, ffn, layers, vocab = 4096, 1024, 14336, 32, 128_256
    block = (2 * d * d + 2 * d * kv) + 3 * d * ffn + 2 * d  # attention (q, k, v, o), the MLP, two norms
    embedding = output = vocab * d
    params = layers * block + embedding + output + d
    assert abs(params - 8.03e9) / 8.03e9 < 0.001  # Llama 3.1 8B
    states = 16 * params / 8  # fp32 parameter, gradient, Adam's exp_avg and exp_avg_sq
    gathered = 2 * (embedding + output) + 2 * 2 * block  # bf16: the root and two blocks (one prefetched)
    saved_per_token = 2 * (d + d + kv + kv + d + ffn + ffn + d + d) + 4 * 32  # input, q k v wo w1 w3 w2, attention
    activations = cfg.data.seq_len * cfg.training.micro_batch_size * layers * saved_per_token
    chunk = 1024  # the chunked loss's tokens per chunk
    loss = 2 * 4 * chunk * vocab + 4 * vocab * d  # fp32 logits and their gradient, the output layer's gradient
    estimate = (states + gathered + activations + loss) / GiB
    assert abs(plan.peak_gib - estimate) / estimate < 0.15, (plan.peak_gib, estimate, plan.memory)
    assert plan.verdict.kind == "fits"
    assert not plan.throughput.caveats  # a model of billions: the anchor's MFU carries over

    # Background checkpoints: each rank's fp32 parameters and Adam's two moments, 12 bytes a parameter over 8 ranks,
    # copied to host, times the 8 ranks of a node: about 96 GB (the third GPU review). Set beside slurm.mem.
    host = plan.checkpoint_host
    assert host.mode == "async" and host.ranks_per_node == 8
    assert abs(host.per_node_gib - 12 * params / GiB) / (12 * params / GiB) < 0.01, host
    assert "host memory per node for background checkpoints" in format_plan(plan)
    small_nodes = load_config(REPO / "configs/llama3/8b.toml", ["--slurm.mem=64G"], environ={})
    assert checkpoint_host(small_nodes, 8, plan.memory.state).lines()[1] == (
        "  EXCEEDS the node's 64 GiB (slurm.mem 64G): `auto` saves synchronously instead")
    explicit = load_config(REPO / "configs/llama3/8b.toml", ["--slurm.mem=64G", "--checkpoint.async_mode=async"],
                           environ={})
    assert "async_mode = 'async' is refused before step 1" in checkpoint_host(explicit, 8, plan.memory.state).lines()[1]
    big_nodes = load_config(REPO / "configs/llama3/8b.toml", ["--slurm.mem=1T"], environ={})
    assert not checkpoint_host(big_nodes, 8, plan.memory.state).exceeds
    sync = load_config(REPO / "configs/llama3/8b.toml", ["--checkpoint.async_mode=off"], environ={})
    assert checkpoint_host(sync, 8, plan.memory.state).per_node_gib == 0


def test_usable_memory_from_what_torch_measures_less_context_and_buffers():
    """An 80 GB H100 shows 79.2 GiB to torch; a run on several has the CUDA context and NCCL's buffers less, then
    the allocator's share. Llama 3 8B at micro-batch 2 on 8 of them (71.8 GiB planned; torchtitan measured 77 GiB
    reserved at that shape) is tight, not 'fits with 0.24 GiB of headroom' (the third GPU review's G9)."""
    h100 = device_memory("H100", 80, gpus=8)
    assert round(h100.total_gib, 1) == 79.2 and h100.context_gib > 0 and h100.communication_gib > 0
    assert h100.usable_gib < h100.room_gib < h100.total_gib
    assert device_memory("H100", 80, gpus=1).communication_gib == 0
    assert verdict(71.76, h100).kind == "tight"
    assert verdict(45.59, h100).kind == "fits"
    assert verdict(h100.usable_gib - 1.9, h100).kind == "tight"  # under 2 GiB of headroom
    assert verdict(h100.room_gib + 0.1, h100).kind == "out_of_memory"
    assert device_memory("H100 NVL", 94, gpus=1).total_from.startswith("estimated")


def test_plan_that_does_not_fit_names_changes_that_do(capsys):
    """The demo at a large micro-batch on one device of 6.4 GiB: out of memory, exit code 1, the changes named; the
    first that fits does when planned again with its override."""
    args = ["plan", str(DEMO_CONFIG), "--gpus", "1", "--gpu", "a100", "--gpu-memory", "6.4", *BIG_BATCH]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == exit_codes.CHECK_FAILED
    text = capsys.readouterr().out
    assert "per rank" in text and "runs out of memory by" in text and "changes that fit" in text, text
    assert "torchtitan, Llama 3 8B on 64 A100" in text  # A100's own MFU anchor, named
    assert "a small model (1.6M parameters" in text  # whose time is no estimate
    fitting = re.findall(r"^  (--\S+)\s+peak\s+([0-9.]+) GiB  fits;", text, re.MULTILINE)
    assert fitting, text
    override, peak = fitting[0]
    changed = load_config(DEMO_CONFIG, [*BIG_BATCH, override], environ={})
    again = make_plan(changed, 1, "a100", gpu_memory=6.4, advise=False)
    assert again.verdict.kind == "fits" and f"{again.peak_gib:.2f}" == peak
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(DEMO_CONFIG)])  # a CPU config: the GPUs must be given
    assert exit_info.value.code == exit_codes.BAD_INPUT
    assert "--gpus" in capsys.readouterr().err


def test_ranks_all_builds_every_rank_of_an_eight_rank_pipeline(capsys):
    """HSDP 2 x 2 with 2 pipeline stages: each rank's stage and layers, and a checkpoint that covers every tensor;
    the memory of a pipeline is not planned yet, which the output says."""
    main(["plan", str(DEMO_CONFIG), "--gpus", "8", "--ranks", "all", "--parallel.dp_replicate=2",
          "--parallel.dp_shard=2", "--parallel.pp=2", "--training.global_batch_size=64",
          "--training.micro_batch_size=4"])
    out = capsys.readouterr().out
    assert "memory not planned: parallel.pp = 2" in out
    assert "every rank of 8: builds" in out
    assert "ranks 0-3: pipeline stage(s) 0, layers 0-1" in out and "ranks 4-7: pipeline stage(s) 1, layers 2-3" in out
    assert "it resumes at any layout" in out


def test_a_float8_plan_says_its_rows_are_approximate_and_its_time_is_bf16s():
    """torch's trackers misfile torchao's float8 storages (Llama 3 8B: 'gradients 28.1 GiB, activations 1.4'), and
    the time estimate has no float8 speed-up to apply: the plan says both (the third GPU review's G8)."""
    from maester.plan.table import format_plan

    cfg = load_config(DEMO_CONFIG, ["--training.float8.enabled=true", "--parallel.compile=true",
                                    "--training.micro_batch_size=8"], environ={})
    text = format_plan(make_plan(cfg, 2, "h100", advise=False))
    assert "(float8: the rows are approximate, their sum is whole: see assumed)" in text, text
    assert "float8: torch's memory trackers file the storages of torchao's float8 tensors" in text
    assert "x 1.00: float8 (tensorwise) estimated as bf16" in text
