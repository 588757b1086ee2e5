"""N3: the chunked loss under tensor parallel. Two gloo processes on CPU: the model's summed loss through
loss_parallel, in chunks of tokens, equals the unchunked one and one process's, gradients included, for an untied
and a tied (Gemma 2: soft-capped logits) head; and the loss's peak memory (torch's MemTracker) is bounded by the
chunk, not by the tokens x V / tp logits."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from maester.config import ModelConfig
from maester.models.build import build_on_meta, materialize, resolve_args
from tests import forkserver

TOKENS, VOCAB, DIM, CHUNK = 512, 4096, 32, 32  # the memory check: 512 x 2048 local fp32 logits = 4 MiB


def summed_loss_and_grads(model, ids, labels, chunk_elements: int):
    """The model's summed token loss under loss_parallel with `chunk_elements` logits per chunk, and the gradients,
    whole."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    import maester.models.loss as loss_module

    model.zero_grad()
    whole = loss_module.CHUNK_ELEMENTS
    loss_module.CHUNK_ELEMENTS = chunk_elements
    try:
        with loss_parallel():
            loss = model(ids, labels=labels)
            loss.backward()
    finally:
        loss_module.CHUNK_ELEMENTS = whole

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    return full(loss.detach()), {name: full(p.grad) for name, p in model.named_parameters()}


def check_losses_and_gradients(world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from maester.parallel.parallelize import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for name, tied in (("llama", False), ("gemma2", True)):
        cfg = ModelConfig(name=name, flavor="tiny", attention="sdpa", overrides={"tie_embeddings": tied})
        args = resolve_args(cfg, 269)
        reference = materialize(build_on_meta(cfg, args), torch.device("cpu"), seed=1)
        model = materialize(build_on_meta(cfg, args), torch.device("cpu"), seed=1)
        apply_tensor_parallel(model, mesh)
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, args.vocab_size, (2, 16), generator=g)
        labels = torch.randint(0, args.vocab_size, (2, 16), generator=g)
        labels[0, :3] = -100
        local_vocab = args.vocab_size // world
        one_chunk = summed_loss_and_grads(model, ids, labels, 2**27)
        # 4 tokens a chunk: 8 chunks, each a loss_parallel cross-entropy over this rank's V / tp columns
        chunked = summed_loss_and_grads(model, ids, labels, 4 * local_vocab)
        expected = reference(ids, labels=labels)
        expected.backward()
        for got in (one_chunk, chunked):
            torch.testing.assert_close(got[0], expected.detach(), rtol=1e-5, atol=1e-5, msg=name)
            for pname, p in reference.named_parameters():
                # summed, not averaged, over 32 tokens: gradients 32 times the mean loss's
                torch.testing.assert_close(got[1][pname], p.grad, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"{name} {pname} chunked={got is chunked}: {m}")


def loss_peak_bytes(h, weight, labels, chunk_tokens: int) -> int:
    """Peak bytes this rank allocates for the loss's forward and backward (MemTracker: tensors as they are made
    and freed), beyond its inputs."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor.parallel import loss_parallel

    from maester.models.loss import linear_cross_entropy_sum

    h.grad = weight.grad = None
    tracker = MemTracker()
    tracker.track_external(h, weight)
    with tracker, loss_parallel():
        linear_cross_entropy_sum(h, weight, labels, chunk_tokens=chunk_tokens).backward()
    return sum(peak["Total"] for peak in tracker.get_tracker_snapshot("peak").values())


def check_peak_memory(world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(3)
    h = distribute_tensor(torch.randn(TOKENS, DIM, generator=g), mesh, [Replicate()]).requires_grad_()
    weight = distribute_tensor(torch.randn(VOCAB, DIM, generator=g), mesh, [Shard(0)]).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    full = loss_peak_bytes(h, weight, labels, TOKENS)
    chunked = loss_peak_bytes(h, weight, labels, CHUNK)
    local_logits = TOKENS * VOCAB // world * 4
    chunk_logits = CHUNK * VOCAB // world * 4
    # unchunked: several copies of this rank's float32 logits (logits, log-softmax, their gradients)
    assert full >= 2 * local_logits, (full, local_logits)
    # chunked: a few chunks' logits, the weight's gradient (VOCAB / tp x DIM) and h's, never the whole logits
    fixed = (VOCAB // world + 2 * TOKENS) * DIM * 4
    assert chunked <= 4 * chunk_logits + 2 * fixed, (chunked, chunk_logits, fixed)
    assert chunked < full / 5, (chunked, full)


def _worker(rank: int, world: int, store: str, errors) -> None:
    # A file store, not a TCP port: tests running side by side cannot meet the wrong peers.
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        check_losses_and_gradients(world)
        check_peak_memory(world)
        torch.distributed.barrier()  # both done before either tears the group down
    except BaseException as e:  # report to the parent: a failing assert in a child is otherwise only printed
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        torch.distributed.destroy_process_group()
    os._exit(0)  # as in test_tp_architectures: no interpreter teardown with gloo's threads


def test_chunked_loss_under_tensor_parallel(tmp_path):
    # Forked from a server that imported torch and maester once: two fresh imports take longer than the checks.
    ctx = forkserver.context()
    errors = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, str(tmp_path / "store"), errors), nprocs=2, join=True,
                       start_method="forkserver")
    assert errors.empty(), errors.get()
