"""What every loader shares: its share of each step (the `BatchPlan` it is built with), the check that a checkpoint's
data position is its own before resuming on it, and `close`."""

from __future__ import annotations

from maester.data.batch import BatchPlan


class LoaderBase:
    """The base of `TextLoader`, `TokenLoader` and `SFTLoader`. A subclass names its state's `KIND`, what its data is
    called in errors (`DATA`, `WHAT`), and how to fingerprint it."""

    KIND: str  # the "kind" its state_dict writes
    WHAT: str  # the loader, in "is not from a ... loader"
    DATA = "data"  # what a different fingerprint means, in "belongs to different ... or another seed"

    def __init__(self, batch: BatchPlan, seed: int):
        self.batch, self.seed = batch, seed
        self.global_batch, self.micro_batch = batch.global_batch, batch.micro_batch
        self.dp_rank, self.dp_size = batch.dp_rank, batch.dp_size

    @property
    def my_rows(self) -> range:
        """This rank's rows of a step's global batch."""
        per_rank = self.batch.per_rank
        return range(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)

    def fingerprint(self) -> str:
        """Identifies the data the positions count in, so that a resume on other data fails instead of drifting."""
        raise NotImplementedError

    def source_commits(self) -> dict[str, str]:
        """Source path -> the commit read of each source on the Hugging Face Hub (`hf://datasets/...`)."""
        return {}

    def check_resume(self, state: dict) -> None:
        """ValueError unless `state` was written by a loader of this kind, on the same data and seed."""
        if state.get("kind") != self.KIND:
            raise ValueError(f"the checkpoint's data position is not from {self.WHAT} loader; refusing to resume on it")
        now = self.source_commits()
        for source, then in state.get("commits", {}).items():
            if now.get(source, then) != then:
                from maester.data.hub_datasets import revision_changed

                raise ValueError(revision_changed(source, then, now[source]))
        if state["fingerprint"] != self.fingerprint() or state["seed"] != self.seed:
            raise ValueError(f"the checkpoint's data position belongs to different {self.DATA} or another seed "
                             f"(checkpoint fingerprint {state['fingerprint']}, seed {state['seed']}; now "
                             f"{self.fingerprint()}, seed {self.seed}); refusing to resume on it")

    def header(self) -> dict:
        """The fields every loader's state_dict starts with, which `check_resume` reads."""
        commits = self.source_commits()
        return {"kind": self.KIND, "fingerprint": self.fingerprint(), "seed": self.seed,
                **({"commits": commits} if commits else {})}

    def close(self) -> None:
        """Stop any worker processes; the next step starts them again."""
