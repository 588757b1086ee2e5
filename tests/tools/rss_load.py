"""Run as a script: load the job argv[1] for inference in dtype argv[2] on the CPU and print, as JSON, how much the
process's peak RSS (VmHWM, reset just before the load through /proc/self/clear_refs) rose above its RSS then, and
how many bytes the parameters take. One-time costs (imports, the first meta build) are paid before."""

from __future__ import annotations

import json
from pathlib import Path
import sys

import torch

from maester.config import Config
from maester.data.tokenizers import build_tokenizer
from maester.models.build import build_on_meta, resolve_args
from maester.tools.generate import load_for_inference
from maester.train.checkpoint import resolve_checkpoint

cfg = Config.from_json_file(resolve_checkpoint(sys.argv[1]) / "config.json")
build_on_meta(cfg.model, resolve_args(cfg.model, build_tokenizer(cfg.tokenizer).vocab_size, cfg.mup))


def status_bytes(key: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024


Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from the current RSS
before = status_bytes("VmRSS")
model, _, _ = load_for_inference(sys.argv[1], torch.device("cpu"), getattr(torch, sys.argv[2]))
grown = status_bytes("VmHWM") - before
print(json.dumps({"peak_growth": grown, "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "dtypes": sorted({str(p.dtype) for p in model.parameters()})}))
