"""Run under torchrun with 2 processes: each rank's Checkpointer looks at its own directory (as two nodes whose
filesystem caches disagree), and every rank must resume from rank 0's choice. Each rank writes result-<rank>.json
(not stdout: two ranks' long lines can interleave in the one pipe torchrun gives them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from maester.config import CheckpointConfig
from maester.train.checkpoint import Checkpointer

dist.init_process_group("gloo")
rank = dist.get_rank()
job = Path(sys.argv[1]) / f"view-{rank}"
try:
    got, _ = Checkpointer(job, CheckpointConfig(), rank).resume_point()
    result = {"rank": rank, "latest": None if got is None else str(got)}
except ValueError as e:
    result = {"rank": rank, "error": str(e)}
(Path(sys.argv[1]) / f"result-{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
