"""The optimizer and learning-rate schedule sections of the config tree (`optimizer`, `schedule`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from maester.config.base import Section


class ParamGroupRule(Section):
    """One rule of `optimizer.groups`: which parameters it takes and how they train. A parameter takes the first
    rule that matches it, the built-in rules last (`maester.train.optim.DEFAULT_RULES`)."""

    name: str
    params: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    """fnmatch patterns over parameter names as the model names them, e.g. `layers.*.attention.*`, `*.bias`,
    `tok_embeddings.weight`, `output.weight`."""
    ndim: list[int] | None = None
    """Tensor ranks the rule takes (1: norm gains and biases, 2: matrices); None: any."""
    lr_multiplier: float = Field(1.0, gt=0)
    """Times the base LR (`optimizer.lr`, or `optimizer.muon.lr` for Muon parameters), before μP and schedule."""
    weight_decay: float | None = Field(None, ge=0)
    """None: `optimizer.weight_decay` (`optimizer.muon.weight_decay` for Muon parameters)."""
    muon: bool | None = None
    """With `optimizer.name = "muon"`: whether these parameters take the Muon update (matrices only) or AdamW;
    None: Muon for the matrices of the transformer blocks, AdamW for everything else."""


class MuonConfig(Section):
    """Muon: momentum, then Newton-Schulz orthogonalisation of each hidden matrix's update."""

    lr: float = Field(0.02, gt=0, allow_inf_nan=False)
    """The base LR of the Muon matrices (`optimizer.lr` is that of the AdamW part); both are printed at start and
    in the console lines."""
    momentum: float = Field(0.95, ge=0, lt=1)
    nesterov: bool = True
    ns_steps: int = Field(5, ge=1)
    coefficients: Literal["quintic", "polar_express"] = "quintic"
    """`quintic`: the fixed (3.4445, -4.7750, 2.0315) of the modded-nanogpt speedruns; `polar_express`: the
    per-iteration coefficients of Polar Express (Amsel et al., 2025)."""
    lr_scaling: Literal["spectral", "match_adamw", "none"] = "spectral"
    """Shape-aware LR: `spectral` x sqrt(max(1, rows / cols)) (Keller Jordan's Muon); `match_adamw`
    x 0.2 sqrt(max(rows, cols)) (Moonlight: an update RMS like AdamW's, so AdamW LRs carry over); `none`."""
    weight_decay: float | None = Field(None, ge=0)
    """Decoupled, after orthogonalisation; None: `optimizer.weight_decay` (0.1 by default)."""
    momentum_warmup_steps: int = Field(0, ge=0)
    """Raise the momentum linearly from `momentum_warmup_start` to `momentum` over this many steps; 0: off."""
    momentum_warmup_start: float = Field(0.85, ge=0, lt=1)
    normuon: bool = False
    """NorMuon: normalise each row of the orthogonalised update by a running RMS (`normuon_beta2`), keeping the
    update's overall norm."""
    normuon_beta2: float = Field(0.95, ge=0, lt=1)
    ns_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Precision of the Newton-Schulz iterations; `auto`: bfloat16 on GPU, float32 on CPU."""


OPTIMIZER_NAMES = ("adamw", "adam", "sgd", "muon")
DECOUPLED_DECAY = ("adamw", "muon")
"""The optimizers whose weight decay is decoupled from the gradient (AdamW's; Muon's matrices and its AdamW part)."""
DEFAULT_DECOUPLED_WEIGHT_DECAY = 0.1


class OptimizerConfig(Section):
    name: str = "adamw"
    """`adamw`, `adam`, `sgd`, `muon` (Muon for hidden matrices and AdamW for the rest, one optimizer), any
    `torch.optim` class by name (`RMSprop`, `Adagrad`, ...) or an importable `package.module.Class`."""
    lr: float = Field(3e-4, gt=0, allow_inf_nan=False)
    """Base LR (Muon's AdamW part included); each group's rule and μP multiply it, the schedule scales it."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam-family only (adamw, adam, Muon's AdamW part)."""
    eps: float = Field(1e-8, gt=0)
    """Adam-family only."""
    weight_decay: float | None = Field(None, ge=0)
    """Default decay of the groups; the built-in rules keep it off embeddings, norms and biases. None: 0.1 where the
    decay is decoupled from the gradient (`adamw`, `muon`: AdamW-style), 0 for the others (`adam`, `sgd` and
    torch.optim classes, whose `weight_decay` is L2 regularisation added to the gradient); a value set with them
    is applied as L2 and said so in the log."""
    momentum: float = Field(0.0, ge=0, lt=1)
    """`sgd` only."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Further keyword arguments of the optimizer class (e.g. `{nesterov = true}` for sgd, `{amsgrad = true}`)."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """`auto`: fused where torch's class has a fused kernel for the device (CPU included), foreach otherwise (where
    the class has one)."""
    groups: list[ParamGroupRule] = Field(default_factory=list)
    """Parameter-group rules, tried in order before the built-in ones; the resolved groups are logged at start."""
    muon: MuonConfig = Field(default_factory=MuonConfig)
    """`name = "muon"` only."""

    @property
    def decoupled_decay(self) -> bool:
        """Whether the optimizer's weight decay is decoupled (AdamW-style), not L2 added to the gradient."""
        return self.name in DECOUPLED_DECAY

    @property
    def resolved_weight_decay(self) -> float:
        """`weight_decay`, or its default for the optimizer: 0.1 when decoupled, else 0."""
        if self.weight_decay is not None:
            return self.weight_decay
        return DEFAULT_DECOUPLED_WEIGHT_DECAY if self.decoupled_decay else 0.0

    @model_validator(mode="after")
    def _check_name(self) -> "OptimizerConfig":
        if self.name.lower() in OPTIMIZER_NAMES:
            object.__setattr__(self, "name", self.name.lower())
        elif not self.name.replace(".", "").replace("_", "").isalnum():
            raise ValueError(f"optimizer.name {self.name!r} is neither one of {', '.join(OPTIMIZER_NAMES)}, a "
                             f"torch.optim class nor a dotted path package.module.Class")
        names = [g.name for g in self.groups]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"optimizer.groups: the rule name(s) {', '.join(dup)} appear more than once")
        if self.name != "muon":
            muon_rules = [g.name for g in self.groups if g.muon is not None]
            if muon_rules:
                raise ValueError(f"optimizer.groups ({', '.join(muon_rules)}) set `muon`, but optimizer.name is "
                                 f"{self.name!r}, not 'muon'")
        return self


class ScheduleConfig(Section):
    name: Literal["constant", "linear", "cosine", "wsd", "step"] = "cosine"
    """Learning-rate multiplier after warmup: constant, linear or cosine decay to `min_lr_ratio`,
    warmup-stable-decay (`wsd`) with a final decay of `decay_fraction` of the steps, or `step`: times
    `step_gamma` at each of `step_milestones`."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup from the schedule's start. Longer than the steps the run schedules (a config shortened
    with `--training.steps`), it is clamped to them with a warning."""
    warmup_fraction: float | None = Field(None, ge=0, le=1)
    """Instead of `warmup_steps`: this share of the steps the run schedules (rounded), so a shortened run warms up
    for the same share of it."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    decay_fraction: float = Field(0.2, gt=0, le=1)
    """`wsd` only: the share of all steps spent decaying (1.0: the whole run decays, as a cooldown run does)."""
    decay_shape: Literal["linear", "1-sqrt", "cosine"] = "linear"
    """`wsd` only: the shape of the final decay."""
    step_milestones: list[int] = Field(default_factory=list)
    """`step` only: the schedule steps (counted from the schedule's start) after which the LR drops."""
    step_gamma: float = Field(0.1, gt=0, le=1)
    """`step` only: the factor of each drop."""

    @model_validator(mode="after")
    def _check_step(self) -> "ScheduleConfig":
        if self.warmup_fraction is not None and self.warmup_steps:
            raise ValueError(f"schedule.warmup_steps = {self.warmup_steps} and schedule.warmup_fraction = "
                             f"{self.warmup_fraction}: set one of them")
        if self.name == "step":
            if not self.step_milestones:
                raise ValueError("schedule.name = 'step' needs schedule.step_milestones (e.g. [6000, 8000])")
            if any(m <= 0 for m in self.step_milestones) or self.step_milestones != sorted(set(self.step_milestones)):
                raise ValueError(f"schedule.step_milestones must be positive and increasing, got "
                                 f"{self.step_milestones}")
        elif self.step_milestones:
            raise ValueError(f"schedule.step_milestones is set, but schedule.name is {self.name!r}, not 'step'")
        return self
