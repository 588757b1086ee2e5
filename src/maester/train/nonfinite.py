"""Non-finite loss or gradient norm: found on the device every step, read on the host only where the loop syncs
anyway (logging steps, before a checkpoint, at the end).

`training.nonfinite = "skip"` drops the bad step's update on the device: torch's fused optimizers (AdamW, Adam,
SGD, ...) take a `found_inf` tensor, as with a gradient scaler, and leave parameters, state and step count as they
were when it is 1. An optimizer without it (Muon, a for-loop or foreach one that cannot be fused) makes the loop
read the flag every step instead, which is said once at the start. `stop` lets the loop run to the next sync point
and then raises `NonFiniteError`, before any checkpoint can hold the damage.

`AfterLoadWatch` looks harder at the first steps after a checkpoint was loaded, where a bit flipped in a file that
its size check cannot see shows: a non-finite loss or gradient norm, or a gradient norm of exactly 0 (a dead model),
stops the run naming the checkpoint, whatever `training.nonfinite` says.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("maester")


class NonFiniteError(RuntimeError):
    """Training met a non-finite loss or gradient norm under `training.nonfinite = "stop"`, or skipped more steps
    than `training.max_skipped_steps`."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours `optimizer.found_inf` (torch's fused kernels do)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in optimizer.param_groups)


class NonFiniteGuard:
    def __init__(self, policy: str, max_skipped: int, optimizer: torch.optim.Optimizer, device: torch.device,
                 group: dist.ProcessGroup | None = None):
        self.policy, self.max_skipped, self.optimizer, self.group = policy, max_skipped, optimizer, group
        self.on_device = policy == "skip" and skips_on_device(optimizer)
        self.sync_every_step = policy == "skip" and not self.on_device
        self.skipped = torch.zeros((), dtype=torch.float32, device=device)
        self.first_bad = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped_steps = 0  # as of the last check
        if self.sync_every_step:
            log.info("training.nonfinite = 'skip': %s takes no found_inf flag (only fused torch optimizers do), "
                     "so each step's finiteness is read on the host (one sync per step)", type(optimizer).__name__)

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Record step `step`'s finiteness before its optimizer step; False: the caller must not step (only when
        the flag is read on the host)."""
        device = self.skipped.device  # the parameters' (CPU under cpu_offload, while the loss is on the GPU)
        bad = (~torch.isfinite(loss.detach().to(device)) | ~torch.isfinite(grad_norm.detach().to(device))).float()
        if self.group is not None:  # a rank's own loss share may be the only bad one: all ranks must agree
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        self.first_bad = torch.where((self.first_bad == 0) & (bad > 0), step, self.first_bad)
        if self.policy != "skip":
            return True
        self.skipped += bad
        if self.on_device:
            self.optimizer.found_inf = bad
            return True
        return not bool(bad.item())

    def check(self) -> int:
        """Raise where the policy says the run must end; else return the steps skipped so far (one host read)."""
        skipped, first_bad = (int(v) for v in torch.stack([self.skipped.double(), self.first_bad.double()]).tolist())
        self.skipped_steps = skipped
        if first_bad and self.policy == "stop":
            raise NonFiniteError(f"non-finite loss or gradient norm at step {first_bad} (training.nonfinite = "
                                 f"'stop'); no checkpoint was saved after it", first_bad)
        if self.policy == "skip" and skipped > self.max_skipped:
            raise NonFiniteError(f"{skipped} steps had a non-finite loss or gradient norm and were skipped, the "
                                 f"first at step {first_bad}: more than training.max_skipped_steps = "
                                 f"{self.max_skipped}", first_bad)
        return skipped


class AfterLoadWatch:
    """The first `STEPS` steps after checkpoint `path` was loaded at step `step`: each is read on the host (one sync
    a step, for these steps only), and one with a non-finite loss or gradient norm, or a gradient norm of exactly 0,
    raises a ValueError naming the checkpoint (the trainer then sets aside what it saved since; meanwhile, after a
    load checked by size only, its saves delete no older checkpoint). A damaged weight shows at once, a damaged optimizer state after its first update;
    an fp16 step whose scaled gradients overflowed is the loss scaler's to handle."""

    STEPS = 10

    def __init__(self, path: Path, step: int, device: torch.device, group: dist.ProcessGroup | None = None):
        self.path, self.until, self.group = path, step + self.STEPS, group
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self.values = torch.zeros(2, device=device)

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, overflow: torch.Tensor | None) -> None:
        """`loss`: this rank's share of the step's loss when `group` (the ranks that share it) is given."""
        loss, grad_norm = loss.detach().float().to(self.bad.device), grad_norm.detach().float().to(self.bad.device)
        bad = ~torch.isfinite(loss) | ~torch.isfinite(grad_norm) | (grad_norm == 0)
        if overflow is not None:
            bad = bad & (overflow.to(self.bad.device) == 0)
        if self.group is not None:  # as NonFiniteGuard: every rank must raise, or the one that does waits alone
            bad = bad.float()
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
            bad = bad > 0
        self.bad, self.values = bad, torch.stack([loss, grad_norm])

    def check(self, step: int, checkpointer, writer=None) -> bool:
        """Raise if step `step` went wrong, after setting aside the checkpoints `checkpointer` saved since; True (and
        its retention free again) once the watched steps are over. `writer` (rank 0's) gets the `watch` event."""
        event = {"event": "watch", "step": step, "checkpoint": str(self.path)}
        if bool(self.bad.item()):
            loss, norm = self.values.tolist()
            moved = checkpointer.set_aside_after(self.path)
            if writer is not None:
                writer.write_event({**event, "verdict": "failed", "loss": loss, "grad_norm": norm, "set_aside": moved})
            raise ValueError(f"step {step}, {step - self.until + self.STEPS} step(s) after loading the checkpoint "
                             f"{self.path}, has a loss of {loss:.4f} and a gradient norm of {norm:.4g}: the model "
                             f"loaded cannot train. The checkpoint is damaged (`maester checkpoint verify "
                             f"{self.path} --level full` reads every byte) or was saved from a broken model; move it "
                             f"aside to resume from an earlier one"
                             + (f"; the checkpoints saved since, {', '.join(moved)}, are set aside" if moved else ""))
        if step >= self.until:
            checkpointer.hold_retention = False
            if writer is not None:
                writer.write_event({**event, "verdict": "passed"})
            return True
        return False
