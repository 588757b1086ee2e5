"""Hugging Face `transformers` interop: config.json <-> `TransformerArgs`, parameter names and safetensors files.

Pure mappings (no `transformers` import). Each architecture lists its per-layer names on both sides; GPT-NeoX's
fused, per-head-interleaved `query_key_value` is split into q, k and v here and fused back on export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from maester.models.args import RopeScaling, TransformerArgs

# maester architecture -> (HF model_type, HF class)
HF_NAMES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),
    "gpt_neox": ("gpt_neox", "GPTNeoXForCausalLM"),
}
_FROM_MODEL_TYPE = {model_type: name for name, (model_type, _) in HF_NAMES.items()} | {"gemma3": "gemma3"}
_ACTIVATIONS = {"llama": "silu", "qwen3": "silu", "olmo2": "silu", "gemma3": "gelu_pytorch_tanh", "gpt_neox": "gelu"}


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
                            f"{', '.join(sorted(_FROM_MODEL_TYPE))}")
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
        tie_embeddings=hf.get("tie_word_embeddings", name == "gemma3"),
    )
    if hf.get("head_dim") and hf["head_dim"] != hf["hidden_size"] // n_heads:
        fields["head_dim"] = hf["head_dim"]
    if name == "gpt_neox":
        theta, scaling, partial = _rope(hf, None, where)
        fields.update(norm="layer", norm_eps=hf.get("layer_norm_eps", 1e-5), mlp="gelu", mlp_bias=True,
                      parallel_residual=hf.get("use_parallel_residual", True),
                      attention_bias=hf.get("attention_bias", True),
                      rotary_fraction=partial if partial is not None else hf.get("rotary_pct", 0.25),
                      rope_theta=theta if theta is not None else hf.get("rotary_emb_base", 10000.0),
                      rope_scaling=scaling)
        return name, fields
    fields.update(norm_eps=hf.get("rms_norm_eps", 1e-6), attention_bias=hf.get("attention_bias", False),
                  mlp_bias=hf.get("mlp_bias", False))
    if name == "gemma3":
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(key) is not None:
                raise HFFormatError(f"{where}: {key} = {hf[key]} is not supported")
        if hf.get("use_bidirectional_attention"):
            raise HFFormatError(f"{where}: use_bidirectional_attention is not supported (causal models only)")
        theta, scaling, _ = _rope(hf, "full_attention", where)
        per_type = isinstance(hf.get("rope_parameters"), dict) and "sliding_attention" in hf["rope_parameters"]
        if per_type:  # transformers 5
            local_theta, local_scaling, _ = _rope(hf, "sliding_attention", where)
        else:  # transformers 4: rope_theta and rope_scaling are the global layers'
            local_theta, local_scaling = hf.get("rope_local_base_freq"), None
        if local_scaling is not None:
            raise HFFormatError(f"{where}: scaled RoPE on sliding-window layers is not supported")
        fields.update(norm="rms_offset", norm_placement="sandwich", qk_norm="head", mlp="geglu",
                      embedding_scale=True, head_dim=hf.get("head_dim", 256),
                      query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
                      rope_theta=theta if theta is not None else 1_000_000.0, rope_scaling=scaling,
                      local_rope_theta=local_theta if local_theta is not None else 10_000.0,
                      sliding_window=hf.get("sliding_window", 4096),
                      sliding_window_pattern=_sliding_pattern(hf, where))
        return name, fields
    theta, scaling, _ = _rope(hf, None, where)
    fields.update(rope_theta=theta if theta is not None else 10000.0, rope_scaling=scaling)
    if name == "qwen3":
        if hf.get("use_sliding_window"):
            raise HFFormatError(f"{where}: use_sliding_window is not supported for qwen3")
        fields.update(qk_norm="head", head_dim=hf.get("head_dim", 128))
    elif name == "olmo2":
        fields.update(norm_placement="post", qk_norm="full")
    return name, fields


def _sliding_pattern(hf: dict, where: str) -> int:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        return hf.get("sliding_window_pattern", 6)
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
    if name == "gemma3":
        del cfg["hidden_act"]
        scalar = args.query_pre_attn_scalar or args.resolved_head_dim
        cfg.update(hidden_activation=_ACTIVATIONS[name], query_pre_attn_scalar=int(scalar) if float(scalar).is_integer()
                   else scalar,
                   sliding_window=args.sliding_window, rope_local_base_freq=args.local_rope_theta,
                   sliding_window_pattern=args.sliding_window_pattern,
                   layer_types=["full_attention" if args.layer_window(i) is None else "sliding_attention"
                                for i in range(args.n_layers)],
                   final_logit_softcapping=None, attn_logit_softcapping=None)
    return cfg


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
    _, fields = args_from_hf(hf_config(name, args))
    ref = next(iter(ARCHITECTURES[name].flavors.values()))
    expected = TransformerArgs(**{**ref.model_dump(), **fields, "attention": args.attention,
                                  "init_std": args.init_std})
    differing = list(args.differences(expected, ignore=("attention", "init_std")))
    if differing:
        raise HFFormatError(f"this {name} model sets {', '.join(differing)} to values HF's {HF_NAMES[name][1]} "
                            f"cannot express")


# ---------------------------------------------------------------- parameter names


def _norm_pairs(name: str) -> list[tuple[str, str]]:
    if name == "gemma3":
        return [("attention_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffn_norm", "post_feedforward_layernorm")]
    if name == "olmo2":
        return [("post_attention_norm", "post_attention_layernorm"),
                ("post_ffn_norm", "post_feedforward_layernorm")]
    return [("attention_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]


def name_map(name: str, args: TransformerArgs) -> dict[str, str]:
    """maester parameter name -> HF name, for every parameter but GPT-NeoX's q/k/v (fused in HF)."""
    norm_params = ("weight", "bias") if args.norm == "layer" else ("weight",)
    neox = name == "gpt_neox"
    base = "gpt_neox." if neox else "model."
    out = {"tok_embeddings.weight": base + ("embed_in.weight" if neox else "embed_tokens.weight")}
    out.update({f"norm.{p}": base + ("final_layer_norm." if neox else "norm.") + p for p in norm_params})
    if not args.tie_embeddings:
        out["output.weight"] = "embed_out.weight" if neox else "lm_head.weight"
    attn_params = ("weight", "bias") if args.attention_bias else ("weight",)
    mlp_params = ("weight", "bias") if args.mlp_bias else ("weight",)
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}.", f"{base}layers.{i}."
        for a, b in _norm_pairs(name):
            out.update({f"{ours}{a}.{p}": f"{theirs}{b}.{p}" for p in norm_params})
        if neox:
            out.update({f"{ours}attention.o_proj.{p}": f"{theirs}attention.dense.{p}" for p in attn_params})
            out.update({f"{ours}feed_forward.up_proj.{p}": f"{theirs}mlp.dense_h_to_4h.{p}" for p in mlp_params})
            out.update({f"{ours}feed_forward.down_proj.{p}": f"{theirs}mlp.dense_4h_to_h.{p}" for p in mlp_params})
            continue
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.update({f"{ours}attention.{proj}.{p}": f"{theirs}self_attn.{proj}.{p}" for p in attn_params})
        if args.qk_norm != "none":
            for n in ("q_norm", "k_norm"):
                out.update({f"{ours}attention.{n}.{p}": f"{theirs}self_attn.{n}.{p}" for p in norm_params})
        for proj in (("gate_proj", "up_proj", "down_proj") if args.mlp != "gelu" else ("up_proj", "down_proj")):
            out.update({f"{ours}feed_forward.{proj}.{p}": f"{theirs}mlp.{proj}.{p}" for p in mlp_params})
    return out


# Buffers some HF checkpoints carry that are not parameters (old GPT-NeoX, old Llama).
_IGNORED_SUFFIXES = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")
_IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _normalise_hf_keys(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gemma 3 multimodal checkpoints nest the text model (`language_model.model.` in transformers 4,
    `model.language_model.` in 5); bring its keys to Gemma3ForCausalLM's."""
    out = {}
    for key, value in tensors.items():
        if key.startswith(_IGNORED_PREFIXES) or key.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "gemma3":
            key = key.replace("language_model.model.", "model.", 1).replace("model.language_model.", "model.", 1)
            key = key.replace("language_model.lm_head.", "lm_head.", 1)
        if name == "gpt_neox" and key.startswith("lm_head."):  # transformers 5's in-memory name
            key = "embed_out." + key[len("lm_head."):]
        out[key] = value
    return out


def state_dict_from_hf(name: str, args: TransformerArgs, tensors: dict[str, torch.Tensor],
                       where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """HF tensors -> maester state dict. Every expected tensor must be present and every present one used
    (a tied head stored anyway must equal the embedding)."""
    tensors = _normalise_hf_keys(name, tensors)
    mapping = name_map(name, args)
    missing = [hf for hf in mapping.values() if hf not in tensors]
    out = {ours: tensors.pop(hf) for ours, hf in mapping.items() if hf in tensors}
    if name == "gpt_neox":
        hd = args.resolved_head_dim
        for i in range(args.n_layers):
            for p in ("weight", "bias") if args.attention_bias else ("weight",):
                key = f"gpt_neox.layers.{i}.attention.query_key_value.{p}"
                if key not in tensors:
                    missing.append(key)
                    continue
                fused = tensors.pop(key)
                want = [3 * args.n_heads * hd] + ([args.dim] if p == "weight" else [])
                if list(fused.shape) != want:
                    raise HFFormatError(f"{_tensor_file(where, key)}: {key} has shape {list(fused.shape)}, but "
                                        f"{_config_file(where)} implies {want}")
                per_head = fused.reshape(args.n_heads, 3, hd, *fused.shape[1:])
                for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                    out[f"layers.{i}.attention.{proj}.{p}"] = per_head[:, j].reshape(args.n_heads * hd,
                                                                                    *fused.shape[1:])
    if args.tie_embeddings:
        head = tensors.pop("lm_head.weight", None)
        if head is not None and "tok_embeddings.weight" in out and not torch.equal(head, out["tok_embeddings.weight"]):
            raise HFFormatError(f"{where}: tie_word_embeddings is set but lm_head.weight differs from the embedding")
    if missing:
        raise HFFormatError(f"{where}: missing {len(missing)} tensors for {name} "
                            f"({args.n_layers} layers): {', '.join(missing[:5])}")
    if tensors:
        raise HFFormatError(f"{where}: {len(tensors)} tensors this {name} model has no place for: "
                            f"{', '.join(sorted(tensors)[:5])}")
    _check_shapes(name, args, out, mapping, where)
    return out


def _check_shapes(name: str, args: TransformerArgs, state: dict[str, torch.Tensor], mapping: dict[str, str],
                  where: str) -> None:
    """Every tensor has the shape the config implies (a model of `args` built on the meta device)."""
    from maester.models.transformer import Transformer

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    for key, tensor in state.items():
        want = expected.get(key)
        if want is None or tuple(tensor.shape) == want:
            continue
        hf_key = mapping.get(key, key)
        config = _config_file(where)
        hint = ""
        if key in ("tok_embeddings.weight", "output.weight") and tensor.shape[0] != want[0]:
            hint = f" (vocab_size = {args.vocab_size} in {config}; the tensor has {tensor.shape[0]} rows)"
        raise HFFormatError(f"{_tensor_file(where, hf_key)}: {hf_key} has shape {list(tensor.shape)}, but "
                            f"{config} implies {list(want)}{hint}")


def _config_file(where: str) -> str:
    """The config.json of the HF directory `where` for an error message (just "config.json" when `where` is no
    directory)."""
    file = Path(where) / "config.json"
    return str(file) if file.is_file() else "config.json"


def _tensor_file(where: str, hf_key: str) -> str:
    """The safetensors file of the HF directory `where` that holds `hf_key`, for an error message (`where`
    itself when that cannot be told)."""
    directory = Path(where)
    try:
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            file = json.loads(index.read_text())["weight_map"].get(hf_key)
            return str(directory / file) if isinstance(file, str) else where
        if (directory / "model.safetensors").is_file():
            return str(directory / "model.safetensors")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return where


def state_dict_to_hf(name: str, args: TransformerArgs, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """maester state dict -> HF tensors (inverse of `state_dict_from_hf`)."""
    state = dict(state)
    out = {hf: state.pop(ours) for ours, hf in name_map(name, args).items()}
    if name == "gpt_neox":
        for i in range(args.n_layers):
            for p in ("weight", "bias") if args.attention_bias else ("weight",):
                parts = [state.pop(f"layers.{i}.attention.{proj}.{p}") for proj in ("q_proj", "k_proj", "v_proj")]
                per_head = torch.stack([t.reshape(args.n_heads, -1, *t.shape[1:]) for t in parts], dim=1)
                out[f"gpt_neox.layers.{i}.attention.query_key_value.{p}"] = per_head.reshape(-1, *parts[0].shape[1:])
    if state:
        raise HFFormatError(f"no HF name for {', '.join(sorted(state)[:5])}")
    return out


# ---------------------------------------------------------------- safetensors files


def read_hf_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory: model.safetensors, or the shards its index lists."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            raw = json.loads(index.read_text())
            weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError("no weight_map object")
            if not all(isinstance(f, str) and f for f in weight_map.values()):
                raise ValueError("a value in weight_map is not a file name")
            files = sorted(set(weight_map.values()))
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError among them
            detail = str(e)
            raise HFFormatError(f"{index}: not an HF weight index ({detail}; it maps each tensor name to the "
                                f"safetensors file that holds it)") from None
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HFFormatError(f"{directory}: neither model.safetensors nor model.safetensors.index.json "
                            f"(PyTorch .bin checkpoints are not read: convert them to safetensors)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not (directory / file).is_file():
            raise HFFormatError(f"{index}: lists {file}, which is missing")
        try:
            tensors.update(load_file(directory / file))
        except Exception as e:  # safetensors' SafetensorError: truncated, a bad header
            if type(e).__name__ != "SafetensorError" and not isinstance(e, OSError):
                raise
            raise HFFormatError(f"{directory / file}: not a readable safetensors file ({e})") from None
    return tensors


def write_hf_tensors(directory: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    """Write safetensors into `directory`: one model.safetensors, or shards of at most `max_shard_bytes`
    (a larger tensor gets a shard of its own) with model.safetensors.index.json. Returns the files written."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], directory / "model.safetensors", metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        save_file(shard, directory / file, metadata={"format": "pt"})
        weight_map.update({key: file for key in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names + ["model.safetensors.index.json"]
