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
"""The device ran out of memory."""
COLLECTIVE = 6
"""A collective failed or timed out: another rank died or hung, or the network failed."""
INTERRUPTED = 130
"""Ctrl-C, or SIGTERM in a data tool: 128 + SIGINT, as a shell reports it."""
