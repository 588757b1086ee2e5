"""What `maester` exits with, in one place: a job script, a SLURM requeue and a sweep all read these."""

CHECK_FAILED = 1
"""`maester checkpoint verify` found a damaged checkpoint; `maester preflight` found a collective wrong."""
BAD_INPUT = 2
"""A bad config, file or argument: the message names it."""
REQUEUE = 3
"""Training stopped on a request (SIGTERM, SIGUSR1, the stop file) after saving a checkpoint: run it again."""
NONFINITE = 4
"""The loss or the gradients became NaN or infinite."""
OUT_OF_MEMORY = 5
"""The device (or, on the CPU, the host) ran out of memory."""
COLLECTIVE = 6
"""A collective failed or timed out: another rank died or hung, or the network failed."""
INTERRUPTED = 130
"""Ctrl-C, or SIGTERM in a data tool: 128 + SIGINT, as a shell reports it."""

NOT_RETRIED = frozenset({BAD_INPUT, NONFINITE, INTERRUPTED})
"""Failures that a restart from the latest checkpoint would only repeat (a bad config or file, a loss that
diverges again from the same state) or that a person asked for: `slurm.max_restarts` never retries them."""


def name_of(code: int) -> str:
    """What a training exit status means, in a word: one of the constants above (1 is an unhandled exception, whose
    traceback the log holds), a signal (`SIGKILL` for -9, as torchrun reports a killed worker, or 128 + 9, as a
    shell does), or `EXIT_<code>`."""
    import signal

    names = {1: "ERROR", BAD_INPUT: "BAD_INPUT", REQUEUE: "REQUEUE", NONFINITE: "NONFINITE",
             OUT_OF_MEMORY: "OUT_OF_MEMORY", COLLECTIVE: "COLLECTIVE", INTERRUPTED: "INTERRUPTED"}
    if code in names:
        return names[code]
    for number in (-code, code - 128):
        if number > 0:
            try:
                return signal.Signals(number).name
            except ValueError:
                pass
    return f"EXIT_{code}"
