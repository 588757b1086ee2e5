"""Which host each rank runs on: gathered once when training starts, logged, and written to `metrics.jsonl` as a
`hosts` event, so that `maester status` and a reader of the log see the nodes of a run (a multi-node job whose
ranks all landed on one host shows it at once)."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("maester")

NAME_BYTES = 256
"""The longest hostname gathered (a DNS name has at most 253 characters)."""


def gather_hosts() -> list[str]:
    """The hostname of every rank, in rank order: one all-gather of fixed-size byte tensors on the host (gloo, which
    the default group serves on GPUs too: `devices.process_group_backend`); one process: its own. A collective:
    every rank calls it."""
    import torch
    import torch.distributed as dist

    name = socket.gethostname()
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        hosts = [name]
    else:
        mine = torch.zeros(NAME_BYTES, dtype=torch.uint8)
        encoded = name.encode()[:NAME_BYTES]
        mine[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        hosts = [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in every]
    log.info("ranks on %s", describe_hosts(ranks_by_host(hosts)))
    return hosts


def ranks_by_host(hosts: list[str]) -> dict[str, list[int]]:
    """{hostname: its ranks}, hosts in the order of their first rank."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    return by_host


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


def describe_hosts(by_host: dict[str, list[int]]) -> str:
    """`2 node(s): node1 (ranks 0-1), node2 (ranks 2-3)`."""
    return f"{len(by_host)} node(s): " + ", ".join(f"{host} ({_ranks(ranks)})" for host, ranks in by_host.items())


def hosts_event(hosts: list[str], step: int) -> dict:
    """The `events.jsonl` event of the ranks' hosts at the start of a run (a resume writes its own)."""
    slurm = {"slurm_job_id": os.environ["SLURM_JOB_ID"]} if os.environ.get("SLURM_JOB_ID") else {}
    return {"event": "hosts", "step": step, "hosts": ranks_by_host(hosts), **slurm}
