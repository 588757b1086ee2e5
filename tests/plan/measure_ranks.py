"""Run under torchrun: each layout's step measured on real tensors by torch's memory trackers
(`maester.plan.memory.measure_rank_memory`) on this rank, written as JSON to OUT/<layout>-rank<R>.json.

    torchrun --nproc_per_node=N tests/plan/measure_ranks.py OUT CONFIG LAYOUT=--a=1,--b=2 [LAYOUT=...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from maester.config import load_config
from maester.plan.memory import measure_rank_memory


def main(out: str, config: str, layouts: list[str]) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    for spec in layouts:
        name, _, overrides = spec.partition("=")
        cfg = load_config(config, overrides.split(","), environ={})
        step = measure_rank_memory(cfg, torch.device("cpu"))
        path = Path(out) / f"{name}-rank{dist.get_rank()}.json"
        path.write_text(json.dumps(step.to_json()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
