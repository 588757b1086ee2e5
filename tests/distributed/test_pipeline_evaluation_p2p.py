"""N16: pipeline evaluation's point-to-point sends go over the pp group with its own ranks (not the world's global
ranks, which made new communicators per stage pair), and carry tensors of any rank and dtype. Three gloo
processes: the "pp group" is global ranks 1 and 2, group ranks 0 and 1."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from tests import forkserver

TENSORS = [torch.arange(12, dtype=torch.float32).reshape(3, 4),
           torch.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5).to(torch.bfloat16),
           torch.arange(6, dtype=torch.int64).reshape(1, 2, 3)]


def _worker(rank: int, store: str, errors) -> None:
    import torch.distributed as dist

    from maester.parallel.pipeline import receive_tensor, send_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    try:
        group = dist.new_group([1, 2])
        if rank in (1, 2):
            me = dist.get_rank(group)
            assert me == rank - 1
            for t in TENSORS:  # group rank 0 (global 1) to group rank 1 (global 2) and back
                if me == 0:
                    send_tensor(t, 1, group)
                    got = receive_tensor(1, group, torch.device("cpu"))
                else:
                    got = receive_tensor(0, group, torch.device("cpu"))
                    send_tensor(got, 0, group)
                assert got.dtype == t.dtype and torch.equal(got, t), (rank, t.shape)
        dist.barrier()
    except BaseException as e:  # report to the parent: a failing assert in a child is otherwise only printed
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()
    os._exit(0)


def test_evaluation_sends_over_the_pp_group_with_its_ranks(tmp_path):
    ctx = forkserver.context()
    errors = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(str(tmp_path / "store"), errors), nprocs=3, join=True,
                       start_method="forkserver")
    assert errors.empty(), errors.get()
