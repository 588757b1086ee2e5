"""A plan as the text `maester plan` prints: the per-rank table, the verdict, the alternatives, the time."""

from __future__ import annotations

from maester.plan.make import FLOAT8_ROWS, Plan, hours_text
from maester.plan.memory import GiB

LABELS = {
    "parameters": "parameters (sharded, as stored)",
    "gathered parameters": "gathered parameters (FSDP, for compute)",
    "gradients": "gradients",
    "optimizer state": "optimizer state",
    "activations": "activations at the peak",
    "temporaries": "temporaries at the peak",
}


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def format_plan(plan: Plan) -> str:
    m, t, d = plan.memory, plan.throughput, plan.device
    lines = [f"plan of {plan.source or 'the config'} on {plan.gpus} x {plan.gpu} ({d.total_gib:.1f} GiB, "
             f"{plan.peak_flops / 1e12:,.0f} TFLOP/s dense bf16)",
             f"layout: {plan.layout}", "",
             "per rank (each of them holds the same)".ljust(46) + "GiB"]
    for row, value in m.rows().items():
        lines.append(f"  {LABELS[row]:<42}{value / GiB:>7.2f}")
    lines.append(f"  {'peak, in ' + m.phase:<42}{m.peak / GiB:>7.2f}   of {d.usable_gib:.1f} GiB usable")
    lines.append(f"  {'the loss' + chr(39) + 's temporaries, at their own peak':<42}{m.loss / GiB:>7.2f}")
    if m.host:
        lines.append(f"  {'in host memory (parallel.cpu_offload)':<42}{m.host / GiB:>7.2f}")
    if FLOAT8_ROWS in plan.notes:
        lines.append("  (float8: the rows are approximate, their sum is whole: see assumed)")
    lines += ["", f"usable: {d.describe()}", f"verdict: {plan.verdict.line}"]
    if plan.alternatives:
        lines.append("changes that fit (each planned again), and their cost:" if any(a.fits for a in plan.alternatives)
                     else "no single change below fits; each planned again:")
        width = max(len(a.override) for a in plan.alternatives)
        for a in plan.alternatives:
            lines.append(f"  {a.override:<{width}}  peak {a.peak_gib:6.2f} GiB  "
                         f"{'fits' if a.fits else 'does not fit'}; {a.cost}")
    lines += ["", *plan.checkpoint_host.lines()]
    lines += ["", f"time: {t.flops_per_token / 1e9:,.1f} GFLOP per token at {100 * t.mfu:.0f}% MFU ({t.mfu_source})"]
    for reason in t.caveats + t.factor_reasons:
        lines.append(f"  {reason}")
    lines.append(f"  {t.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, {t.tokens_per_second:,.0f} on "
                 f"{plan.gpus} GPUs; a step of {t.tokens_per_step:,} tokens in {_duration(t.step_seconds)}")
    lines.append(f"  {t.steps:,} steps (training.steps): {_duration(t.total_seconds)}, "
                 f"{hours_text(t.gpu_hours)} GPU-hours")
    lines += ["", "assumed:"] + [f"  {note}" for note in plan.notes]
    return "\n".join(lines)
