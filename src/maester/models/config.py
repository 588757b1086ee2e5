"""The model's section of the config tree: which architecture at which size (`ModelConfig`, with width scaling
for μP sweeps). Here, beside the models, so that building a model never imports the root config; the `mup`
section is `args.MupConfig`, which the architecture arguments hold as they are."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from maester.config.base import Section, format_pydantic_error, suggest
from maester.models.registry import ARCHITECTURES


class ModelConfig(Section):
    name: str = "llama"
    """Architecture name (see `maester.models.registry`): llama, mistral, gemma2, gemma3, qwen2, qwen3, olmo2, phi3,
    gpt_neox."""
    flavor: str = "demo"
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Any architecture field, e.g. `{n_layers = 4}`; replaced by the validated, typed values."""
    width: int | None = Field(None, gt=0)
    """Build the architecture at this width (model dim) with its head dim held fixed: the heads, KV heads and FFN
    width scale with it (μP width sweeps). None: the flavor's own width."""
    hf_config: str | None = None
    """A Hugging Face `config.json` (or the directory holding it, or a Hub id `org/name[@revision]`, whose
    config.json is fetched into the Hugging Face cache) to take the architecture from instead of a flavor; `name` follows its model_type and `overrides` still apply, e.g. a public model with fewer layers."""
    attention: Literal["auto", "sdpa", "flex", "varlen"] = "auto"
    """The attention kernel; it changes speed and memory, never parameters or results. `sdpa`:
    `scaled_dot_product_attention`, with a dense (batch, seq, seq) mask when rows pack several documents; runs
    everywhere. `flex`: FlexAttention with a block-sparse document mask (CUDA; on CPU forward only, it has no
    backward there). `varlen`: torch's variable-length attention over the documents of the flattened batch
    (CUDA, bfloat16/float16). `auto`: `flex` on CUDA when rows pack documents, else `sdpa`. A model that soft-caps
    attention scores (Gemma 2) cannot use SDPA's kernels: `auto` gives it `flex` on CUDA, and `sdpa` (or `auto`
    elsewhere) the same attention in plain torch ops; `varlen` is refused."""

    @model_validator(mode="after")
    def _check_architecture(self) -> "ModelConfig":
        if "attention" in self.overrides:
            raise ValueError("model.overrides.attention: the attention kernel is set by model.attention")
        if "mup" in self.overrides:
            raise ValueError("model.overrides.mup: μP is set by the mup section (mup.enabled, mup.base_width, ...)")
        if self.width is not None:
            clash = sorted(set(self.overrides) & set(WIDTH_FIELDS))
            if clash:
                raise ValueError(f"model.width and model.overrides.{clash[0]} exclude each other: the width sets "
                                 f"{', '.join(WIDTH_FIELDS)}")
        if self.hf_config is not None:
            from maester.hub import local_path
            from maester.models.hf import architecture_of, read_hf_config

            if self.flavor != ModelConfig.model_fields["flavor"].default:
                raise ValueError(f"model.flavor ({self.flavor!r}) and model.hf_config exclude each other: the "
                                 f"architecture comes from the HF config")
            config = read_hf_config(local_path(self.hf_config, "model.hf_config", "config"))
            name = architecture_of(config, f"model.hf_config ({self.hf_config})")
            if self.name != name and self.name != ModelConfig.model_fields["name"].default:
                raise ValueError(f"model.name {self.name!r} differs from model.hf_config's model type ({name})")
            object.__setattr__(self, "name", name)
        if self.name not in ARCHITECTURES:
            raise ValueError(f"model.name {self.name!r} is unknown{suggest(self.name, ARCHITECTURES)}")
        flavors = ARCHITECTURES[self.name].flavors
        if self.hf_config is None and self.flavor not in flavors:
            raise ValueError(f"model.flavor {self.flavor!r} is not a flavor of {self.name}"
                             f"{suggest(self.flavor, flavors)}")
        args = self.architecture()
        typed = {k: getattr(args, k) for k in self.overrides}
        typed = {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in typed.items()}
        if typed != self.overrides:
            object.__setattr__(self, "overrides", typed)
        return self

    def architecture(self) -> BaseModel:
        """The flavor's arguments with `overrides` applied and validated."""
        arch = ARCHITECTURES[self.name]
        fields = arch.args_class.model_fields
        bad = [k for k in self.overrides if k not in fields]
        if bad:
            raise ValueError("; ".join(f"model.overrides.{k} is not a field of {self.name}{suggest(k, fields)}"
                                       for k in bad))
        if self.hf_config is not None:
            from maester.hub import local_path
            from maester.models.hf import args_from_hf, read_hf_config

            config = read_hf_config(local_path(self.hf_config, "model.hf_config", "config"))
            base = args_from_hf(config, f"model.hf_config ({self.hf_config})")[1]
        else:
            base = arch.flavors[self.flavor].model_dump()
        if self.width is not None:
            base = scale_width(base, self.width)
        merged = {**base, **self.overrides, "attention": self.attention}
        if isinstance(self.overrides.get("moe"), dict) and isinstance(base.get("moe"), dict):
            merged["moe"] = {**base["moe"], **self.overrides["moe"]}  # e.g. {"moe": {"bias_balancing": 0.001}}
        try:
            return arch.args_class.model_validate(merged)
        except ValidationError as e:
            raise ValueError("; ".join(format_pydantic_error(err, "model.overrides", None) for err in e.errors()))


WIDTH_FIELDS = ("dim", "n_heads", "n_kv_heads", "ffn_hidden_dim")


def scale_width(fields: dict[str, Any], width: int) -> dict[str, Any]:
    """Architecture fields scaled to model dim `width`: the head dim and the query heads per KV head stay, the
    head counts and the FFN width scale with the dim."""
    dim, heads, kv = fields["dim"], fields["n_heads"], fields["n_kv_heads"]
    head_dim = fields.get("head_dim") or dim // heads
    if width % head_dim:
        raise ValueError(f"model.width = {width} is not a multiple of the head dim {head_dim}")
    n_heads = width // head_dim
    group = heads // kv
    if n_heads % group:
        raise ValueError(f"model.width = {width} gives {n_heads} heads, not a multiple of the {group} query heads "
                         f"per KV head")
    return {**fields, "dim": width, "n_heads": n_heads, "n_kv_heads": n_heads // group,
            "ffn_hidden_dim": max(1, round(fields["ffn_hidden_dim"] * width / dim)),
            "head_dim": fields.get("head_dim")}
