"""The `maester` command: a table of subcommands, each an (add, run) pair, and the mapping of failures to exit
codes (`maester.exit_codes`). Subcommands parse their arguments, then import what they need (torch only there)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from collections.abc import Callable
from typing import NamedTuple

from maester import exit_codes
from maester.cli import data, plan, tools, training


class Command(NamedTuple):
    add: Callable[[argparse._SubParsersAction, str], None]
    """Adds the command's parser under its name."""
    run: Callable[[argparse.Namespace], None]
    overrides: bool = False
    """Takes config overrides (`--section.key=value`) after its own arguments."""


COMMANDS = {
    "train": Command(training.add_train, training.run_train, overrides=True),
    "seed-checkpoint": Command(training.add_seed_checkpoint, training.run_seed_checkpoint, overrides=True),
    "submit": Command(training.add_submit, training.run_submit, overrides=True),
    "sweep": Command(training.add_sweep, training.run_sweep, overrides=True),
    "mup": Command(training.add_mup, training.run_mup, overrides=True),
    "launch": Command(training.add_launch, training.run_launch),
    "config": Command(training.add_config, training.run_config, overrides=True),
    "generate": Command(tools.add_generate, tools.run_generate),
    "chat": Command(tools.add_chat, tools.run_chat),
    "eval": Command(tools.add_eval, tools.run_eval),
    "convert": Command(tools.add_convert, tools.run_convert),
    "checkpoint": Command(tools.add_checkpoint, tools.run_checkpoint),
    "plot": Command(tools.add_plot, tools.run_plot),
    "report": Command(tools.add_report, tools.run_report),
    "status": Command(tools.add_status, tools.run_status),
    "cancel": Command(tools.add_cancel, tools.run_cancel),
    "preflight": Command(training.add_preflight, training.run_preflight, overrides=True),
    "plan": Command(plan.add_plan, plan.run_plan, overrides=True),
    "data": Command(data.add_data, data.run_data),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="maester", description="Train large language models with PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.add(sub, name)
    return parser


def main(argv: list[str] | None = None) -> None:
    if "torch" not in sys.modules:  # OpenMP reads how its threads wait when torch loads (maester.cpus)
        from maester.cpus import prefer_passive_waiting

        prefer_passive_waiting()
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not COMMANDS[args.command].overrides:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    from maester.config.base import ConfigError
    from maester.config.sources import apply_dotenv
    from maester.progress import stderr_line

    try:
        apply_dotenv(Path.cwd())
        COMMANDS[args.command].run(args)
    except (ConfigError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError,
            ValueError) as e:
        stderr_line(f"maester {args.command}: error: {e}")
        sys.exit(exit_codes.BAD_INPUT)
    except KeyboardInterrupt:
        stderr_line(f"maester {args.command}: interrupted")
        sys.exit(exit_codes.INTERRUPTED)
    except Exception as e:
        code, advice = _training_failure(e)
        if code is None:
            raise
        stderr_line(f"maester {args.command}: error: {e}\n{advice}")
        sys.exit(code)


GLOO_COLLECTIVE_FAILURES = ("gloo/transport", "Connection closed by peer", "Connection reset by peer")


def _training_failure(e: Exception) -> tuple[int | None, str]:
    """The exit code and advice for a failure a run's settings can cause; (None, "") for anything else (a bug:
    its traceback is shown)."""
    import errno

    if isinstance(e, OSError) and e.errno == errno.EROFS:
        return exit_codes.BAD_INPUT, ("the file system is mounted read-only: a job directory must be writable to "
                                      "train (its lock, checkpoints, logs and metrics); outputs such as `report "
                                      "--out` can go elsewhere")
    torch = sys.modules.get("torch")
    if torch is None:
        return None, ""
    from maester.train.nonfinite import NonFiniteError

    if isinstance(e, NonFiniteError):
        return exit_codes.NONFINITE, ("lower optimizer.lr, raise schedule.warmup_steps or set training.max_grad_norm, "
                                "then resume from the latest checkpoint; training.detect_anomaly = true names the "
                                "op that made the first NaN, and training.nonfinite = 'skip' steps over rare ones")
    if isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e):
        return exit_codes.OUT_OF_MEMORY, ("out of host memory: the model or a batch does not fit this machine's "
                                          "RAM (check model.overrides such as vocab_size and dim, and "
                                          "training.micro_batch_size)")
    if isinstance(e, torch.OutOfMemoryError):
        return exit_codes.OUT_OF_MEMORY, ("out of device memory: lower training.micro_batch_size, set "
                                    "parallel.activation_checkpointing, or shard more (parallel.dp_shard); "
                                    "profiling.memory_snapshot = true records where the memory went")
    if isinstance(e, torch.distributed.DistError) or (  # gloo raises plain RuntimeErrors
            isinstance(e, RuntimeError) and any(m in str(e) for m in GLOO_COLLECTIVE_FAILURES)):
        return exit_codes.COLLECTIVE, ("a collective failed or timed out: another rank died or hung (its log says why; "
                                 "logging.per_rank_files = true keeps one per rank), or the network failed; "
                                 "training.train_timeout_seconds bounds the wait")
    return None, ""
