"""Parallelism applied from outside the model: the device mesh, TP/SP, activation checkpointing, compile, FSDP2/DDP."""
