"""`maester plan`: will a config fit, how fast will it run, does its layout build on every rank; before the queue,
on a machine without a GPU. The arguments here, the work in `maester.plan` (torch is imported only there)."""

from __future__ import annotations

import sys

from maester import exit_codes

OVERRIDES_HELP = "then any number of config overrides: --section.key=value or --section.key value"


def add_plan(sub, name: str) -> None:
    p = sub.add_parser(name, help="predict per-rank memory and step time of a config on N GPUs, before the queue",
                       epilog=f"{OVERRIDES_HELP}. Exit codes: 0 the step fits (or fits tightly: see the verdict); "
                              f"{exit_codes.CHECK_FAILED} it is predicted to run out of memory, or --ranks all found a "
                              f"rank that does not build; {exit_codes.BAD_INPUT} a config or layout error.")
    p.add_argument("target", help="a config file (TOML/YAML/JSON) or a job directory")
    p.add_argument("--gpus", type=int, help="GPUs (ranks) of the run (default: slurm.nodes x slurm.gpus_per_node)")
    p.add_argument("--gpu", help="the GPU model: its memory and peak FLOPs come from maester's MFU table (h100, "
                                 "h100-nvl, h200, a100, b200, mi250x, mi300x, ...; default: slurm.gpu, else mi250x "
                                 "with the lumi template, else h100)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB", help="the device memory in GiB as torch reports it "
                                                                    "(total_memory), instead of the table's")
    p.add_argument("--mfu", type=float, help="model FLOPs utilisation for the time estimate, e.g. 0.4 (default: "
                                              "a published figure, named in the output)")
    p.add_argument("--ranks", choices=("one", "all"), default="one",
                   help="all: also build every rank of the layout (mesh, pipeline stages, expert placement) and "
                        "check that its checkpoint names and shards resume at any layout")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def declared_gpus(cfg) -> int | None:
    """The job's GPUs as its SLURM settings ask for them: nodes x processes per node; None for a CPU job."""
    from maester.jobs.slurm import PRESETS

    s = cfg.slurm
    per_node = s.nproc_per_node or s.gpus_per_node or PRESETS.get(s.template, {}).get("gpus_per_node", 0)
    return s.nodes * per_node if per_node else None


def declared_gpu(cfg) -> tuple[str, str]:
    """(GPU name, where it came from) for the job's plan."""
    if cfg.slurm.gpu:
        return cfg.slurm.gpu, "slurm.gpu"
    if cfg.slurm.template == "lumi":
        return "mi250x", "the lumi template"
    return "h100", "the default"


def run_plan(args) -> None:
    import json

    from maester.jobs.job_dir import config_for_target
    from maester.plan.make import make_plan
    from maester.plan.table import format_plan

    cfg, _ = config_for_target(args.target, args.overrides)
    gpus = args.gpus if args.gpus is not None else declared_gpus(cfg)
    if gpus is None:
        raise ValueError(f"{args.target}: how many GPUs? give --gpus N, or set slurm.nodes and slurm.gpus_per_node")
    gpu, gpu_from = (args.gpu, "--gpu") if args.gpu else declared_gpu(cfg)
    from maester.plan.memory import PlanUnsupported

    try:
        plan = make_plan(cfg, gpus, gpu, source=args.target, mfu=args.mfu, gpu_memory=args.gpu_memory,
                         gpu_from=gpu_from)
    except PlanUnsupported as e:
        if args.ranks != "all":
            raise
        plan, unplanned = None, f"memory not planned: {e}"  # the layout check below still runs
    layout = None
    if args.ranks == "all":
        from maester.plan.layout import check_every_rank

        layout = check_every_rank(cfg, gpus)
    if args.json:
        out = plan.to_json() if plan is not None else {"not_made": unplanned}
        if layout is not None:
            out["ranks_all"] = layout.to_json()
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan) if plan is not None else unplanned)
        if layout is not None:
            print("\n" + layout.describe())
    if (plan is not None and plan.verdict.kind == "out_of_memory") or (layout is not None and not layout.ok):
        sys.exit(exit_codes.CHECK_FAILED)

def plan_before_submit(cfg, force: bool) -> dict | None:
    """`maester submit`'s plan of a GPU job (None for a CPU job: no device memory to check): printed in short, and
    a job predicted to run out of memory refused with the plan's table unless `force`. Returns what plan.json
    holds; a plan this torch cannot make (`PlanUnsupported`) is said and recorded, and the job goes on."""
    from maester.jobs.slurm import SubmitError
    from maester.plan.make import hours_text, make_plan, with_alternatives
    from maester.plan.memory import PlanUnsupported
    from maester.plan.table import format_plan

    gpus = declared_gpus(cfg)
    if gpus is None:
        return None
    gpu, gpu_from = declared_gpu(cfg)
    try:
        plan = make_plan(cfg, gpus, gpu, source=f"job {cfg.job.name}", gpu_from=gpu_from, advise=False)
    except PlanUnsupported as e:
        print(f"maester submit: no plan: {e}", file=sys.stderr)
        return {"not_made": str(e)}
    if plan.verdict.kind == "out_of_memory" and not force:  # the changes that would fit: for a refusal only
        raise SubmitError(f"the plan predicts this job runs out of memory (--force submits it all the same):\n"
                          f"{format_plan(with_alternatives(plan, cfg))}")
    t = plan.throughput
    print(f"plan: {gpus} x {plan.gpu}: {plan.verdict.line}; about {t.tokens_per_second:,.0f} tokens/s, "
          f"{hours_text(t.gpu_hours)} GPU-hours to step {t.steps:,} (`maester plan` for the "
          f"table)", file=sys.stderr)
    return plan.to_json()
