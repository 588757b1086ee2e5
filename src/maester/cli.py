"""The `maester` command. Subcommands parse their arguments, then import what they need (torch only there)."""

from __future__ import annotations

import argparse
import os
import sys

OVERRIDES_HELP = "then any number of config overrides: --section.key=value or --section.key value"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="maester", description="Train large language models with PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train from a config file or a job directory (resumes automatically)",
                       epilog=OVERRIDES_HELP)
    p.add_argument("target", help="a config file (TOML/YAML/JSON) or a job directory jobs/<name>")

    p = sub.add_parser("seed-checkpoint", epilog=OVERRIDES_HELP,
                       help="initialise the model on one process and save it as the job's step-0 checkpoint")
    p.add_argument("target", help="a config file or a job directory")

    p = sub.add_parser("submit", help="create the job directory jobs/<name> for a config", epilog=OVERRIDES_HELP)
    p.add_argument("config", help="a config file (TOML/YAML/JSON)")
    p.add_argument("--name", help="job name (default: job.name from the config)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and paths, write nothing")

    p = sub.add_parser("config", help="inspect configs")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = csub.add_parser("show", help="print the resolved config tree", epilog=OVERRIDES_HELP)
    show.add_argument("config", help="a config file or a job directory")
    show.add_argument("--format", choices=("json", "yaml"), default="json")

    p = sub.add_parser("generate", help="sample text from a job's latest checkpoint or a checkpoint directory")
    p.add_argument("target", help="a job directory or a checkpoint directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))

    p = sub.add_parser("plot", help="write the loss curve of a job as PNG")
    p.add_argument("job", help="a job directory")
    p.add_argument("--out", help="output path (default: <job>/loss.png)")
    return parser


TAKES_OVERRIDES = {"train", "seed-checkpoint", "submit", "config"}


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in TAKES_OVERRIDES:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    from maester.config import ConfigError

    try:
        COMMANDS[args.command](args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"maester {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)


def _train(args) -> None:
    from maester.jobs.job_dir import config_for_target, write_job_dir
    from maester.train.trainer import Trainer

    import torch.distributed as dist

    from maester.train.trainer import setup_logging

    rank = int(os.environ.get("RANK", "0"))
    setup_logging(None, rank)  # so that config updates are reported
    cfg, job_dir = config_for_target(args.target, args.overrides)
    if rank == 0:
        write_job_dir(cfg, job_dir)
    try:
        result = Trainer(cfg, job_dir).train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print(f"trained to step {result.step}; job directory {job_dir}"
              + (f"; checkpoint {result.checkpoint}" if result.checkpoint else ""))


def _seed_checkpoint(args) -> None:
    from maester.jobs.job_dir import config_for_target, write_job_dir
    from maester.train.trainer import write_seed_checkpoint

    cfg, job_dir = config_for_target(args.target, args.overrides)
    write_job_dir(cfg, job_dir)
    print(f"seed checkpoint {write_seed_checkpoint(cfg, job_dir)}")


def _submit(args) -> None:
    from maester.config import load_config
    from maester.jobs.job_dir import write_job_dir

    overrides = list(args.overrides) + ([f"--job.name={args.name}"] if args.name else [])
    cfg = load_config(args.config, overrides)
    if args.dry_run:
        print(cfg.to_json(), end="")
        print(f"# dry run: would write {cfg.job_dir}/config.json, slurm.sh, logs/, checkpoints/", file=sys.stderr)
        return
    job_dir = write_job_dir(cfg)
    print(f"job directory {job_dir}: run with `maester train {job_dir}` or `sbatch {job_dir}/slurm.sh`")


def _config(args) -> None:
    from maester.jobs.job_dir import config_for_target

    cfg, _ = config_for_target(args.config, args.overrides)
    if args.format == "yaml":
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    else:
        print(cfg.to_json(), end="")


def _generate(args) -> None:
    from maester.parallel.dims import init_distributed
    from maester.tools.generate import load_for_inference, sample

    _, _, device = init_distributed(args.device)  # one process: no process group, just the device
    model, tokenizer, cfg = load_for_inference(args.target, device)
    prompt = ([tokenizer.bos_id] if cfg.data.add_bos else []) + tokenizer.encode(args.prompt)
    out = sample(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                 eos_id=tokenizer.eos_id, seed=args.seed)
    print(args.prompt + tokenizer.decode(out))


def _plot(args) -> None:
    from pathlib import Path

    from maester.tools.plot import plot_loss

    print(plot_loss(Path(args.job), Path(args.out) if args.out else None))


COMMANDS = {"train": _train, "seed-checkpoint": _seed_checkpoint, "submit": _submit, "config": _config, "generate": _generate, "plot": _plot}
