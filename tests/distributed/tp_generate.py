"""Run under torchrun: each job of argv[2:] is loaded tensor parallel over the processes (gloo, CPU) and its prompts
(prompts.json in the job) are decoded greedily, one at a time and as one left-padded batch. Each rank writes
result-<rank>.json into argv[1] (not stdout, where two ranks' lines can interleave)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from maester.tools.generate import load_for_inference, start_inference
from maester.models.sampling import sample, sample_batch

device, dtype, mesh, rank = start_inference("cpu", "auto")
result = {"rank": rank, "world": dist.get_world_size(), "jobs": {}}
for job in sys.argv[2:]:
    model, _, _ = load_for_inference(job, device, dtype, mesh)
    prompts = json.loads((Path(job) / "prompts.json").read_text())
    k_proj = model.layers["0"].attention.k_proj.weight
    result["jobs"][job] = {
        "sharded": isinstance(k_proj, DTensor) and k_proj.to_local().shape[0] * 2 == k_proj.shape[0],
        "dtype": str(k_proj.dtype),
        "one_at_a_time": [sample(model, p, 8) for p in prompts],
        "batched": sample_batch(model, prompts, 8),
        "sampled": sample(model, prompts[0], 8, temperature=1.0, seed=5),
    }
(Path(sys.argv[1]) / f"result-{rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
