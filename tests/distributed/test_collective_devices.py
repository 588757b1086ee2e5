"""No collective of a training run reaches a backend that cannot serve its tensor's device.

On GPUs the process group maps CPU tensors to gloo and CUDA tensors to NCCL/RCCL ("cpu:gloo,cuda:nccl"). NCCL
alone serves CUDA tensors only: a host statistic all-reduced on it crashed every multi-GPU run at its first
logging step. gloo on CPU accepts everything, so these runs record every collective (its tensors' devices, its
group's device->backend map) and check them against the map.
"""

from __future__ import annotations

import json

import torch.distributed as dist

from tests.data.test_sft import write_conversations
from tests.distributed.collective_audit import unserved
from tests.helpers import REPO, tiny_overrides, torchrun, write_corpus



def audit(tmp_path, name, overrides, ddp_sync: list | None = None, reads: list | None = None) -> list[dict]:
    """The collectives of both ranks; `reads`, when given, gets their host reads."""
    out = tmp_path / f"audit-{name}"
    reads = [] if reads is None else reads
    proc = torchrun(2, [str(out), *overrides], tmp_path, script=REPO / "tests" / "distributed" / "collective_audit.py")
    assert proc.returncode == 0, proc.stderr[-4000:]
    reads.extend(json.loads((out / "reads-0.json").read_text()) + json.loads((out / "reads-1.json").read_text()))
    if ddp_sync is not None:
        ddp_sync.extend(json.loads((out / "ddp-sync-0.json").read_text()))
    return [r for rank in (0, 1) for r in json.loads((out / f"rank-{rank}.json").read_text())]


def test_gpu_backend_map_gives_host_tensors_to_gloo():
    from maester.parallel.devices import process_group_backend

    assert dist.BackendConfig(dist.Backend(process_group_backend("cuda"))).get_device_backend_map() == {
        "cpu": "gloo", "cuda": "nccl"}
    assert process_group_backend("cpu") == "gloo"


def test_unserved_flags_a_host_tensor_on_an_nccl_only_group():
    record = {"op": "all_reduce", "devices": ["cpu"], "backends": "cuda:nccl", "caller": "trainer.py:x"}
    assert unserved([record]) == [record]
    assert unserved([{**record, "backends": "cpu:gloo,cuda:nccl"}]) == []


def test_pretraining_collectives_reach_a_backend_for_their_device(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.parquet")
    records = audit(tmp_path, "pretrain", tiny_overrides(
        corpus, tmp_path / "jobs", "pretrain", training__steps=4, checkpoint__interval=2, logging__interval=2,
        training__global_batch_size=4, training__micro_batch_size=2))
    assert unserved(records) == []
    assert all(set(r["backends"].split(",")) == {"cpu:gloo", "cuda:gloo"} for r in records), \
        "a group lost the device map"
    callers = {r["caller"] for r in records}
    # the logging step's statistics, the loss normalisation, the stop agreement and the checkpoint all took part
    assert {"metrics.py:batch_metrics", "trainer.py:_forward_backward", "preemption.py:agree"} <= callers, callers
    assert any(c.startswith("checkpoint.py") for c in callers), callers

    # a resume of the same job (training.steps raised): the watch of the steps after the load takes part too
    resumed = audit(tmp_path, "resume", tiny_overrides(
        corpus, tmp_path / "jobs", "pretrain", training__steps=6, checkpoint__interval=2, logging__interval=2,
        training__global_batch_size=4, training__micro_batch_size=2))
    assert unserved(resumed) == []

    def observed(rs: list[dict]) -> int:  # the non-finite guard's all-reduce, and the watch's beside it
        return sum(r["caller"] == "nonfinite.py:observe" for r in rs)

    assert observed(records) / 4 > 0 and observed(resumed) / 2 == 2 * observed(records) / 4  # per step


def test_sft_collectives_reach_a_backend_for_their_device(tmp_path):
    chats = tmp_path / "chats.jsonl"
    write_conversations(chats, 60)
    records = audit(tmp_path, "sft", tiny_overrides(
        chats, tmp_path / "jobs", "sft", data__mode="sft", data__seq_len=128,
        data__sources=json.dumps([{"path": str(chats), "validation_fraction": 0.2}]), training__steps=4,
        logging__eval_interval=2, checkpoint__interval=2, schedule__name="constant", schedule__warmup_steps=0))
    assert unserved(records) == []
    callers = {r["caller"] for r in records}
    assert {"sft_loader.py:_trained_everywhere", "trainer.py:evaluate"} <= callers, callers


def test_ddp_collectives_and_one_gradient_all_reduce_per_step(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.parquet")
    sync: list = []
    records = audit(tmp_path, "ddp", tiny_overrides(
        corpus, tmp_path / "jobs", "ddp", training__steps=3, parallel__dp_replicate=2, parallel__dp_shard=1,
        training__global_batch_size=8, training__micro_batch_size=2, checkpoint__interval=0), ddp_sync=sync)
    assert unserved(records) == []
    # two micro-batches per rank and step: the first accumulates without syncing, the last all-reduces
    assert sync == [False, True] * 3


def reads_between_logging_steps(reads: list[dict], logging_steps: set[int]) -> set[tuple[str, str]]:
    """(read, caller) of the reads on training steps that do not log: on a GPU each drains the queue."""
    return {(r["read"], r["caller"]) for r in reads if r["step"] > 0 and r["step"] not in logging_steps}


def assert_served_and_mapped(records: list[dict]) -> set[str]:
    """No collective on a backend that cannot serve its tensors, no group without the device map; the callers."""
    assert unserved(records) == []
    assert all(set(r["backends"].split(",")) == {"cpu:gloo", "cuda:gloo"} for r in records), \
        "a group lost the device map"
    return {r["caller"] for r in records}


def test_context_parallel_collectives_reach_a_backend_for_their_device(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.parquet")
    reads: list = []
    records = audit(tmp_path, "cp", tiny_overrides(
        corpus, tmp_path / "jobs", "cp", parallel__cp=2, data__document_masking="true",
        training__steps=4, logging__interval=4, checkpoint__interval=0, checkpoint__save_final="false"), reads=reads)
    callers = assert_served_and_mapped(records)
    assert reads_between_logging_steps(reads, {1, 4}) == set()
    assert any(r["caller"] == "trainer.py:_log" for r in reads), "the reads were not recorded"
    ops = {(r["op"], r["caller"]) for r in records}
    # the keys' documents and the keys and values gathered in forward (functional collectives), and their
    # gradients reduce-scattered in backward
    assert ("maester.cp_all_gather", "context_parallel.py:split") in ops, ops
    assert ("maester.cp_all_gather", "context_parallel.py:gather_keys_and_values") in ops, ops
    assert ("maester.cp_reduce_scatter", "context_parallel.py:_all_gather_backward") in ops, ops
    assert "trainer.py:_forward_backward" in callers, callers
    # FSDP over dp_shard x cp (torch 2.15's FSDP2 gathers with all_gather_single)
    assert {"all_gather_single", "all_gather_into_tensor"} & {op for op, _ in ops}, ops


def test_pipeline_collectives_and_point_to_point_reach_a_backend_for_their_device(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.parquet")
    reads: list = []
    records = audit(tmp_path, "pp", tiny_overrides(
        corpus, tmp_path / "jobs", "pp", parallel__pp=2, parallel__pp_schedule="1F1B",
        model__overrides__n_layers=4, training__steps=4, training__global_batch_size=4,
        training__micro_batch_size=1, logging__interval=4, logging__eval_interval=4, checkpoint__interval=0,
        checkpoint__save_final="false", data__sources=f'[{{"path": "{corpus}", "validation_fraction": 0.1}}]'),
        reads=reads)
    callers = assert_served_and_mapped(records)
    # torch's pipelining reads the stages' shapes on the first step only
    assert reads_between_logging_steps(reads, {1, 4}) == set()
    ops = {r["op"] for r in records}
    # the schedule's activations and gradients between the stages (torch's pipelining), the evaluation's
    # header and hidden states (maester's own), the step loss over the stages and the gradient norm's
    assert ops & {"isend", "irecv", "batch_isend_irecv"}, ops
    assert {"pipeline.py:send_tensor", "pipeline.py:receive_tensor", "pipeline.py:step", "optim.py:clip_grad_norm"} <= callers, \
        callers
    assert {"send", "recv"} <= ops, ops


def test_expert_parallel_collectives_reach_a_backend_for_their_device(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.parquet")
    reads: list = []
    records = audit(tmp_path, "ep", tiny_overrides(
        corpus, tmp_path / "jobs", "ep", model__name="olmoe", parallel__ep=2, training__steps=4,
        logging__interval=4, checkpoint__interval=0, checkpoint__save_final="false"), reads=reads)
    callers = assert_served_and_mapped(records)
    # per MoE layer: the all-to-all's splits (as torchtitan reads them), nothing else: the expert loop (the CPU
    # has no grouped GEMM) takes its group sizes from those host counts. The dispatch reads them through
    # `moe.group_sizes` (one read, which a memory plan on fake tensors replaces with balanced sizes).
    assert reads_between_logging_steps(reads, {1, 4}) == {("tolist", "moe.py:group_sizes")}
    ops = {(r["op"], r["caller"]) for r in records}
    # the counts per expert exchanged (c10d), the tokens there and back (functional collectives), and in
    # backward (called from the step's backward) the tokens' gradients the same ways
    assert ("all_to_all_single", "expert_parallel.py:dispatch") in ops, ops
    functional = "_c10d_functional.all_to_all_single"
    assert {(functional, "expert_parallel.py:dispatch"), (functional, "expert_parallel.py:combine"),
            (functional, "trainer.py:_forward_backward")} <= ops, ops
    assert "moe.py:moe_metrics" in callers, callers
