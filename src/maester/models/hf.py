"""Hugging Face `transformers` interop, the config side: config.json <-> `TransformerArgs`, both directions.

Pure mappings (no `transformers` import); parameter names and safetensors files are in `maester.models.hf_tensors`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from maester.models.args import MoEArgs, RopeScaling, TransformerArgs

# maester architecture -> (HF model_type, HF class)
HF_NAMES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gpt_neox": ("gpt_neox", "GPTNeoXForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
}
_FROM_MODEL_TYPE = {model_type: name for name, (model_type, _) in HF_NAMES.items()} | {"gemma3": "gemma3"}
_ACTIVATIONS = {name: "silu" for name in HF_NAMES} | {"gemma2": "gelu_pytorch_tanh", "gemma3": "gelu_pytorch_tanh",
                                                      "gpt_neox": "gelu"}
_GEMMA = ("gemma2", "gemma3")


class HFFormatError(ValueError):
    pass


# ---------------------------------------------------------------- config.json


def read_hf_config(path: str | Path) -> dict:
    """The config.json of an HF model directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise HFFormatError(f"{file}: no such file (an HF model directory holds config.json)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{file}: not JSON: {e}") from None


def architecture_of(hf: dict, where: str = "config.json") -> str:
    model_type = hf.get("model_type")
    if model_type not in _FROM_MODEL_TYPE:
        raise HFFormatError(f"{where}: model_type {model_type!r} is not supported; supported: "
                            f"{', '.join(sorted(_FROM_MODEL_TYPE))} (as maester's "
                            f"{', '.join(HF_NAMES)})")
    return _FROM_MODEL_TYPE[model_type]


def _text_config(hf: dict) -> dict:
    """Gemma 3's multimodal checkpoints nest the language model's config in text_config."""
    return {**hf["text_config"], "model_type": "gemma3_text"} if hf.get("model_type") == "gemma3" else hf


def _rope(hf: dict, layer_type: str | None, where: str) -> tuple[float | None, RopeScaling | None, float | None]:
    """(theta, scaling, partial_rotary_factor) from either the `rope_parameters` of transformers 5 or the
    `rope_theta` / `rope_scaling` keys of earlier configs."""
    from pydantic import ValidationError

    params, source = hf.get("rope_parameters"), "rope_parameters"
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params, source = params[layer_type], f"rope_parameters.{layer_type}"
    if not isinstance(params, dict) or ("rope_theta" not in params and "rope_type" not in params):
        params, source = hf.get("rope_scaling") or {}, "rope_scaling"
        if not isinstance(params, dict):
            raise HFFormatError(f"{where}: rope_scaling = {params!r}: must be an object (or null)")
        params = dict(params)
    theta = params.get("rope_theta", hf.get("rope_theta"))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        scaling = None
    elif kind in ("llama3", "linear"):
        fields = {k: params[k] for k in RopeScaling.model_fields if k in params and k != "rope_type"}
        try:
            scaling = RopeScaling(rope_type=kind, **fields)
        except ValidationError as e:
            first = e.errors()[0]
            key = ".".join(str(part) for part in (source, *first["loc"]))
            raise HFFormatError(f"{where}: {key} = {first.get('input')!r}: {first['msg']}") from None
    else:
        raise HFFormatError(f"{where}: rope type {kind!r} is not supported (default, linear, llama3)")
    return theta, scaling, params.get("partial_rotary_factor")


_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def transformer_args_from_hf(hf: dict, where: str = "config.json") -> tuple[str, TransformerArgs]:
    """`args_from_hf` validated into TransformerArgs; a value the model cannot take names the file and the field."""
    from pydantic import ValidationError

    name, fields = args_from_hf(hf, where)
    try:
        return name, TransformerArgs(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(part) for part in first["loc"]]
        value = first.get("input")
        text = _text_config(hf)
        key = next((k for k in _HF_KEYS.get(loc[0], ()) if k in text and text[k] == value), None) if loc else None
        if key is None:  # no config key holds it as such (a default, or a value derived from several keys)
            key = f"maester's {'.'.join(loc) or 'model'} (from this config)"
        raise HFFormatError(f"{where}: {key} = {value!r}: {first['msg']}") from None


# maester TransformerArgs field -> the HF config keys it may come from (for naming a bad value's key)
_HF_KEYS = {
    "dim": ("hidden_size",), "n_layers": ("num_hidden_layers",), "n_heads": ("num_attention_heads",),
    "n_kv_heads": ("num_key_value_heads", "num_attention_heads"), "ffn_hidden_dim": ("intermediate_size",),
    "vocab_size": ("vocab_size",), "max_seq_len": ("max_position_embeddings",),
    "tie_embeddings": ("tie_word_embeddings",), "head_dim": ("head_dim",),
    "norm_eps": ("rms_norm_eps", "layer_norm_eps"), "attention_bias": ("attention_bias",),
    "mlp_bias": ("mlp_bias",), "parallel_residual": ("use_parallel_residual",),
    "rotary_fraction": ("rotary_pct", "partial_rotary_factor"), "rope_theta": ("rope_theta", "rotary_emb_base"),
    "local_rope_theta": ("rope_local_base_freq",), "sliding_window": ("sliding_window",),
    "sliding_window_pattern": ("sliding_window_pattern",), "query_pre_attn_scalar": ("query_pre_attn_scalar",),
    "attn_logit_softcap": ("attn_logit_softcapping",), "final_logit_softcap": ("final_logit_softcapping",),
}


def args_from_hf(hf: dict, where: str = "config.json") -> tuple[str, dict[str, Any]]:
    """(architecture name, TransformerArgs fields) equivalent to an HF config; unsupported features are errors."""
    name = architecture_of(hf, where)
    hf = _text_config(hf)
    for key in _REQUIRED:
        if key not in hf:
            raise HFFormatError(f"{where}: no {key} (an HF {HF_NAMES[name][1]} config has one)")
    for key in (*_REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise HFFormatError(f"{where}: {key} = {value!r}: must be a positive integer")
    act = hf.get("hidden_act", hf.get("hidden_activation", _ACTIVATIONS[name]))
    if act != _ACTIVATIONS[name]:
        raise HFFormatError(f"{where}: hidden_act {act!r}: maester's {name} uses {_ACTIVATIONS[name]!r}")
    n_heads = hf["num_attention_heads"]
    fields: dict[str, Any] = dict(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, ffn_hidden_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=hf.get("tie_word_embeddings", name in _GEMMA),
    )
    if hf.get("head_dim") and hf["head_dim"] != hf["hidden_size"] // n_heads:
        fields["head_dim"] = hf["head_dim"]
    fields.update(_FAMILY_FIELDS[name](hf, where))
    return name, fields


def _gpt_neox_fields(hf: dict, where: str) -> dict[str, Any]:
    theta, scaling, partial = _rope(hf, None, where)
    return dict(norm="layer", norm_eps=hf.get("layer_norm_eps", 1e-5), mlp="gelu", mlp_bias=True,
                parallel_residual=hf.get("use_parallel_residual", True), attention_bias=hf.get("attention_bias", True),
                rotary_fraction=partial if partial is not None else hf.get("rotary_pct", 0.25),
                rope_theta=theta if theta is not None else hf.get("rotary_emb_base", 10000.0), rope_scaling=scaling)


def _llama_fields(hf: dict, where: str) -> dict[str, Any]:
    """Llama's keys; Qwen 3 and OLMo 2 read them as well."""
    theta, scaling, _ = _rope(hf, None, where)
    return dict(norm_eps=hf.get("rms_norm_eps", 1e-6), attention_bias=hf.get("attention_bias", False),
                mlp_bias=hf.get("mlp_bias", False), rope_theta=theta if theta is not None else 10000.0,
                rope_scaling=scaling)


def _unbiased_fields(hf: dict, where: str, eps: float) -> dict[str, Any]:
    """RMSNorm eps and RoPE: the keys of a class without bias switches (Mistral, Qwen 2, Phi-3)."""
    theta, scaling, _ = _rope(hf, None, where)
    return dict(norm_eps=hf.get("rms_norm_eps", eps), rope_theta=theta if theta is not None else 10000.0,
                rope_scaling=scaling)


def _all_layers_window(hf: dict, where: str, window: int | None) -> int | None:
    """`window` for a class that slides every layer or none (Mistral, Phi-3); `layer_types` must agree."""
    types = hf.get("layer_types")
    if types is not None and set(types) != {"sliding_attention" if window is not None else "full_attention"}:
        raise HFFormatError(f"{where}: layer_types {types} with sliding_window = {window}: HF's "
                            f"{hf.get('model_type')} applies sliding_window to every layer")
    return window


def _mistral_fields(hf: dict, where: str) -> dict[str, Any]:
    # MistralConfig's own default is a 4096-token window (v0.1); later models write null.
    window = _all_layers_window(hf, where, hf.get("sliding_window", 4096))
    return _unbiased_fields(hf, where, 1e-6) | dict(sliding_window=window)


def _phi3_fields(hf: dict, where: str) -> dict[str, Any]:
    window = _all_layers_window(hf, where, hf.get("sliding_window"))
    partial = _rope(hf, None, where)[2]  # in rope_parameters (transformers 5) or beside it (4)
    return _unbiased_fields(hf, where, 1e-5) | dict(
        sliding_window=window, rotary_fraction=partial if partial is not None else hf.get("partial_rotary_factor", 1.0))


def _qwen2_fields(hf: dict, where: str) -> dict[str, Any]:
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise HFFormatError(f"{where}: use_sliding_window is not supported for qwen2 (its sliding layers are the "
                            f"ones from max_window_layers up, which maester's layer pattern cannot express)")
    return _unbiased_fields(hf, where, 1e-6) | dict(qkv_bias=True)


def _qwen3_fields(hf: dict, where: str) -> dict[str, Any]:
    if hf.get("use_sliding_window"):
        raise HFFormatError(f"{where}: use_sliding_window is not supported for qwen3")
    return _llama_fields(hf, where) | dict(qk_norm="head", head_dim=hf.get("head_dim", 128))


def _olmo2_fields(hf: dict, where: str) -> dict[str, Any]:
    return _llama_fields(hf, where) | dict(norm_placement="post", qk_norm="full")


def _moe_args(hf: dict, where: str, hidden_key: str, norm_topk_prob: bool | None = None) -> MoEArgs:
    """The experts of OLMoE, Qwen 3 MoE and Mixtral: count, top-k, hidden size, renormalised top-k (a config key,
    or fixed by the class: `norm_topk_prob`), aux-loss weight."""
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 writes the second
    for key, value in (("num_experts", n_experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                       (hidden_key, hf.get(hidden_key))):
        if value is None:
            raise HFFormatError(f"{where}: no {key} (an HF {hf.get('model_type')} config has one)")
    return MoEArgs(n_experts=n_experts, top_k=hf["num_experts_per_tok"], expert_hidden_dim=hf[hidden_key],
                   norm_topk_prob=hf.get("norm_topk_prob", False) if norm_topk_prob is None else norm_topk_prob,
                   aux_loss_coef=hf.get("router_aux_loss_coef", 0.0))


def _olmoe_fields(hf: dict, where: str) -> dict[str, Any]:
    if hf.get("clip_qkv") is not None:
        raise HFFormatError(f"{where}: clip_qkv = {hf['clip_qkv']!r} is not supported (null only)")
    return _llama_fields(hf, where) | dict(norm_eps=hf.get("rms_norm_eps", 1e-5), qk_norm="full",
                                           moe=_moe_args(hf, where, "intermediate_size"))


def _qwen3_moe_fields(hf: dict, where: str) -> dict[str, Any]:
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise HFFormatError(f"{where}: dense layers among the MoE ones (mlp_only_layers, decoder_sparse_step) are "
                            f"not supported: every layer must be sparse")
    return _qwen3_fields(hf, where) | dict(moe=_moe_args(hf, where, "moe_intermediate_size"))


def _mixtral_fields(hf: dict, where: str) -> dict[str, Any]:
    if hf.get("router_jitter_noise"):
        raise HFFormatError(f"{where}: router_jitter_noise = {hf['router_jitter_noise']!r} is not supported (0 only)")
    window = _all_layers_window(hf, where, hf.get("sliding_window"))
    return _unbiased_fields(hf, where, 1e-5) | dict(
        sliding_window=window, moe=_moe_args(hf, where, "intermediate_size", norm_topk_prob=True))


def _gemma_fields(hf: dict, where: str) -> dict[str, Any]:
    """Gemma 2 and 3: sandwich (1 + w) RMSNorms, GeGLU, scaled embeddings, sliding layers, soft-capping (on by
    default in Gemma 2's config class, off in Gemma 3's); Gemma 3 adds QK-norm and a local RoPE base."""
    gemma2 = hf.get("model_type") == "gemma2"
    if hf.get("use_bidirectional_attention"):
        raise HFFormatError(f"{where}: use_bidirectional_attention is not supported (causal models only)")
    fields = dict(norm="rms_offset", norm_placement="sandwich", mlp="geglu", embedding_scale=True,
                  norm_eps=hf.get("rms_norm_eps", 1e-6), attention_bias=hf.get("attention_bias", False),
                  mlp_bias=hf.get("mlp_bias", False), head_dim=hf.get("head_dim", 256),
                  query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
                  sliding_window=hf.get("sliding_window", 4096),
                  sliding_window_pattern=_sliding_pattern(hf, where, 2 if gemma2 else 6),
                  attn_logit_softcap=hf.get("attn_logit_softcapping", 50.0 if gemma2 else None),
                  final_logit_softcap=hf.get("final_logit_softcapping", 30.0 if gemma2 else None))
    if gemma2:
        theta, scaling, _ = _rope(hf, None, where)
        return fields | dict(rope_theta=theta if theta is not None else 10_000.0, rope_scaling=scaling)
    theta, scaling, _ = _rope(hf, "full_attention", where)
    per_type = isinstance(hf.get("rope_parameters"), dict) and "sliding_attention" in hf["rope_parameters"]
    if per_type:  # transformers 5
        local_theta, local_scaling, _ = _rope(hf, "sliding_attention", where)
    else:  # transformers 4: rope_theta and rope_scaling are the global layers'
        local_theta, local_scaling = hf.get("rope_local_base_freq"), None
    if local_scaling is not None:
        raise HFFormatError(f"{where}: scaled RoPE on sliding-window layers is not supported")
    return fields | dict(qk_norm="head", rope_theta=theta if theta is not None else 1_000_000.0,
                         rope_scaling=scaling, local_rope_theta=local_theta if local_theta is not None else 10_000.0)


_FAMILY_FIELDS = {
    "llama": _llama_fields, "mistral": _mistral_fields, "gemma2": _gemma_fields, "gemma3": _gemma_fields,
    "qwen2": _qwen2_fields, "qwen3": _qwen3_fields, "olmo2": _olmo2_fields, "phi3": _phi3_fields,
    "gpt_neox": _gpt_neox_fields, "olmoe": _olmoe_fields, "qwen3_moe": _qwen3_moe_fields,
    "mixtral": _mixtral_fields,
}


def _sliding_pattern(hf: dict, where: str, default: int) -> int:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        return hf.get("sliding_window_pattern", default)
    for pattern in range(1, n + 2):
        if types == ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]:
            return pattern
    if all(t == "sliding_attention" for t in types):
        return 0
    raise HFFormatError(f"{where}: layer_types {types} is not 'every n-th layer global'")


def hf_config(name: str, args: TransformerArgs, *, bos_id: int | None = None, eos_id: int | None = None,
              pad_id: int | None = None, dtype: str = "float32") -> dict:
    """An HF config.json for `args`, in the keys both transformers 4 and 5 read."""
    model_type, cls = HF_NAMES[name]
    cfg: dict[str, Any] = dict(
        architectures=[cls], model_type=model_type, hidden_size=args.dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, intermediate_size=args.ffn_hidden_dim,
        vocab_size=args.vocab_size, max_position_embeddings=args.max_seq_len, head_dim=args.resolved_head_dim,
        tie_word_embeddings=args.tie_embeddings, hidden_act=_ACTIVATIONS[name], initializer_range=args.init_std,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, torch_dtype=dtype, use_cache=True,
        attention_bias=args.attention_bias,
    )
    scaling = None if args.rope_scaling is None else args.rope_scaling.model_dump()
    if name == "gpt_neox":
        del cfg["num_key_value_heads"], cfg["head_dim"]
        cfg.update(layer_norm_eps=args.norm_eps, rotary_pct=args.rotary_fraction, rotary_emb_base=args.rope_theta,
                   use_parallel_residual=args.parallel_residual, rope_scaling=scaling)
        return cfg
    cfg.update(rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, rope_scaling=scaling)
    if name == "llama":
        cfg["mlp_bias"] = args.mlp_bias
    if name in ("mistral", "qwen2", "phi3", "mixtral"):  # classes without a bias switch
        del cfg["attention_bias"]
    if name in ("mistral", "phi3", "mixtral"):
        cfg["sliding_window"] = args.sliding_window  # every layer's, null for none
    if name == "phi3":
        cfg["partial_rotary_factor"] = args.rotary_fraction
    if name == "qwen2":
        cfg["use_sliding_window"] = False
    if name in _GEMMA:
        _gemma_config(name, args, cfg)
    if args.moe is not None:
        _moe_config(name, args.moe, cfg)
    return cfg


def _moe_config(name: str, moe: MoEArgs, cfg: dict[str, Any]) -> None:
    cfg.update(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coef, output_router_logits=False)
    if name == "mixtral":  # always renormalises the top-k gates
        cfg.update(num_local_experts=moe.n_experts, intermediate_size=moe.expert_hidden_dim, router_jitter_noise=0.0)
        return
    cfg.update(num_experts=moe.n_experts, norm_topk_prob=moe.norm_topk_prob)
    if name == "qwen3_moe":
        cfg.update(moe_intermediate_size=moe.expert_hidden_dim, decoder_sparse_step=1, mlp_only_layers=[],
                   use_sliding_window=False)
    else:  # OLMoE: intermediate_size is the experts'
        cfg.update(intermediate_size=moe.expert_hidden_dim, clip_qkv=None)


def _gemma_config(name: str, args: TransformerArgs, cfg: dict[str, Any]) -> None:
    del cfg["hidden_act"]
    scalar = args.query_pre_attn_scalar or args.resolved_head_dim
    cfg.update(hidden_activation=_ACTIVATIONS[name], query_pre_attn_scalar=int(scalar) if float(scalar).is_integer()
               else scalar, sliding_window=args.sliding_window,
               layer_types=["full_attention" if args.layer_window(i) is None else "sliding_attention"
                            for i in range(args.n_layers)],
               final_logit_softcapping=args.final_logit_softcap, attn_logit_softcapping=args.attn_logit_softcap)
    if name == "gemma3":
        cfg.update(rope_local_base_freq=args.local_rope_theta, sliding_window_pattern=args.sliding_window_pattern)


def check_convertible(name: str, args: TransformerArgs) -> None:
    """Refuse exports HF's class for `name` could not express (an override transformers has no key for, or μP
    multipliers that change what the model computes)."""
    from maester.models.registry import ARCHITECTURES

    if args.mup:
        deviations = args.mup_deviations()
        if deviations:
            raise HFFormatError(f"this {name} model uses mup (μP, width multiplier m = {args.width_mult:g}), which "
                                f"changes {'; '.join(deviations)}: HF's {HF_NAMES[name][1]} has no μP multipliers "
                                f"(a μP model exports where these stay as without μP, e.g. at m = 1 with "
                                f"mup.input_alpha = mup.output_alpha = 1 and mup.base_head_dim unset)")
        # μP that leaves the function unchanged (its init settings aside) is the plain architecture.
        args = args.model_copy(update={"mup": None})
    if args.moe is not None and args.moe.bias_balancing:
        raise HFFormatError(f"this {name} model chooses experts with a learned bias (moe.bias_balancing), which HF's "
                            f"{HF_NAMES[name][1]} does not have: its routing would differ")
    _, fields = args_from_hf(hf_config(name, args))
    if args.moe is not None and "moe" in fields:  # the z-loss is a training setting no HF config carries
        fields["moe"] = fields["moe"].model_copy(update={"z_loss_coef": args.moe.z_loss_coef})
    ref = next(iter(ARCHITECTURES[name].flavors.values()))
    expected = TransformerArgs(**{**ref.model_dump(), **fields, "attention": args.attention,
                                  "init_std": args.init_std})
    differing = list(args.differences(expected, ignore=("attention", "init_std")))
    if differing:
        raise HFFormatError(f"this {name} model sets {', '.join(differing)} to values HF's {HF_NAMES[name][1]} "
                            f"cannot express")
