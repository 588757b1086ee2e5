"""Tensor parallel computes the same losses and gradients as one process, for every architecture: two gloo
processes on CPU, each comparing its TP model with an unsharded copy of the same weights."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from maester.config import ModelConfig
from maester.models.build import build_on_meta, materialize, resolve_args
from tests import forkserver

ARCHS = ["llama", "gemma3", "qwen3", "olmo2", "gpt_neox"]
# Gemma 2 once, for its soft-capped scores and (vocabulary-sharded) logits, with its tied head. The other later
# families are modules already here: Qwen 2's q/k/v biases are GPT-NeoX's without the output's, Mistral and
# Phi-3 are Llama's (HF's fused names aside) with Gemma 3's sliding windows.
CASES = [(name, tied) for name in ARCHS for tied in (False, True)] + [("gemma2", True)]


def _worker(rank: int, world: int, store: str, name: str, tied: bool, errors):
    # A file store, not a TCP port: tests running side by side cannot meet the wrong peers.
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        from maester.parallel.parallelize import apply_tensor_parallel, uses_loss_parallel

        cfg = ModelConfig(name=name, flavor="tiny", attention="sdpa", overrides={"tie_embeddings": tied})
        args = resolve_args(cfg, 269)
        reference = materialize(build_on_meta(cfg, args), torch.device("cpu"), seed=1)
        model = materialize(build_on_meta(cfg, args), torch.device("cpu"), seed=1)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        apply_tensor_parallel(model, mesh)
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, args.vocab_size, (2, 16), generator=g)
        labels = torch.randint(0, args.vocab_size, (2, 16), generator=g)
        docs = torch.tensor([[0] * 10 + [1] * 6, [0] * 16])

        expected = F.cross_entropy(reference(ids, document_ids=docs).flatten(0, 1), labels.flatten())
        expected.backward()
        logits = model(ids, document_ids=docs)
        if uses_loss_parallel(model):
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                loss.backward()
        else:
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        assert uses_loss_parallel(model), "TP gives vocabulary-sharded logits, tied or not"
        with torch.no_grad(), loss_parallel():  # the trainer's path: the model's own summed loss
            summed = model(ids, document_ids=docs, labels=labels)
        summed = summed.full_tensor() if isinstance(summed, DTensor) else summed
        torch.testing.assert_close(summed / labels.numel(), expected, rtol=1e-5, atol=1e-6)
        ref_params = dict(reference.named_parameters())
        for pname, p in model.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, ref_params[pname].grad, rtol=1e-4, atol=1e-6, msg=pname)
        # Both ranks done before either tears the group down: a peer closing its connection while gloo still
        # talks to it aborts the other process.
        torch.distributed.barrier()
    except BaseException as e:  # report to the parent: a failing assert in a child is otherwise only printed
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        torch.distributed.destroy_process_group()
    # Checked and torn down: leave without the interpreter's teardown, where a C++ thread of the group left
    # joinable now and then aborted a process that had passed ("terminate called without an active exception").
    os._exit(0)


@pytest.mark.parametrize("name, tied", CASES, ids=[f"{n}-{'tied' if t else 'untied'}" for n, t in CASES])
def test_tensor_parallel_matches_one_process(name, tied, tmp_path):
    # forked from a server that imported torch and maester once (11 cases, 22 processes), not each anew (spawn)
    ctx = forkserver.context()
    errors = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, str(tmp_path / "store"), name, tied, errors), nprocs=2, join=True,
                       start_method="forkserver")
    assert errors.empty(), errors.get()
