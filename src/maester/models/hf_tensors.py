"""Hugging Face `transformers` interop, the weights side: maester parameter names <-> HF names, and safetensors
files. Each architecture lists its per-layer names on both sides. Fused HF tensors are split on import and fused
back on export: GPT-NeoX's per-head-interleaved `query_key_value`, and Phi-3's `qkv_proj` and `gate_up_proj`
(q, k and v, or gate and up, stacked by rows). MoE experts, one HF tensor per expert and projection, are stacked
into maester's (n_experts, out, in) weights and split back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from maester.models.args import TransformerArgs
from maester.models.hf import HFFormatError


# ---------------------------------------------------------------- parameter names


def _norm_pairs(name: str) -> list[tuple[str, str]]:
    if name in ("gemma2", "gemma3"):
        return [("attention_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffn_norm", "post_feedforward_layernorm")]
    if name == "olmo2":
        return [("post_attention_norm", "post_attention_layernorm"),
                ("post_ffn_norm", "post_feedforward_layernorm")]
    return [("attention_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]


def name_map(name: str, args: TransformerArgs) -> dict[str, str]:
    """maester parameter name -> HF name, for every parameter but those fused in HF (GPT-NeoX's q/k/v, Phi-3's
    q/k/v and gate/up: `_stacked`) and the experts (one HF tensor per expert: `_expert_stacks`)."""
    norm_params = ("weight", "bias") if args.norm == "layer" else ("weight",)
    neox = name == "gpt_neox"
    base = "gpt_neox." if neox else "model."
    out = {"tok_embeddings.weight": base + ("embed_in.weight" if neox else "embed_tokens.weight")}
    out.update({f"norm.{p}": base + ("final_layer_norm." if neox else "norm.") + p for p in norm_params})
    if not args.tie_embeddings:
        out["output.weight"] = "embed_out.weight" if neox else "lm_head.weight"
    attn_params = ("weight", "bias") if args.attention_bias else ("weight",)
    qkv_params = ("weight", "bias") if args.attention_bias or args.qkv_bias else ("weight",)
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
        fused = name == "phi3"
        for proj in ("o_proj",) if fused else ("q_proj", "k_proj", "v_proj", "o_proj"):
            params = attn_params if proj == "o_proj" else qkv_params
            out.update({f"{ours}attention.{proj}.{p}": f"{theirs}self_attn.{proj}.{p}" for p in params})
        if args.qk_norm != "none":
            for n in ("q_norm", "k_norm"):
                out.update({f"{ours}attention.{n}.{p}": f"{theirs}self_attn.{n}.{p}" for p in norm_params})
        if args.moe is not None:  # the router; the experts are stacked (`_expert_stacks`)
            out[f"{ours}feed_forward.router.gate.weight"] = f"{theirs}{_moe_module(name)}.gate.weight"
            continue
        projs = ("up_proj", "down_proj") if args.mlp == "gelu" else ("gate_proj", "up_proj", "down_proj")
        for proj in ("down_proj",) if fused else projs:
            out.update({f"{ours}feed_forward.{proj}.{p}": f"{theirs}mlp.{proj}.{p}" for p in mlp_params})
    return out


def _stacked(name: str, args: TransformerArgs) -> dict[str, list[tuple[str, int]]]:
    """HF tensors that stack several maester weights by rows (Phi-3's `qkv_proj` and `gate_up_proj`): HF name ->
    [(maester name, rows)], in the order stacked."""
    if name != "phi3":
        return {}
    q, kv, ffn = args.n_heads * args.resolved_head_dim, args.n_kv_heads * args.resolved_head_dim, args.ffn_hidden_dim
    out = {}
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out[f"{theirs}self_attn.qkv_proj.weight"] = [(f"{ours}attention.q_proj.weight", q),
                                                     (f"{ours}attention.k_proj.weight", kv),
                                                     (f"{ours}attention.v_proj.weight", kv)]
        out[f"{theirs}mlp.gate_up_proj.weight"] = [(f"{ours}feed_forward.gate_proj.weight", ffn),
                                                   (f"{ours}feed_forward.up_proj.weight", ffn)]
    return out


def _moe_module(name: str) -> str:
    """Where an HF checkpoint keeps a layer's router and experts."""
    return "block_sparse_moe" if name == "mixtral" else "mlp"


_MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _expert_stacks(name: str, args: TransformerArgs) -> dict[str, list[str]]:
    """maester's stacked expert weights (n_experts, out, in) -> the HF tensors of each expert, in order (the
    checkpoint format of OLMoE, Qwen 3 MoE and Mixtral, which transformers 5 also writes, fusing them only in
    memory)."""
    if args.moe is None:
        return {}
    out = {}
    for i in range(args.n_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            theirs = _MIXTRAL_EXPERT_NAMES[proj] if name == "mixtral" else proj
            out[f"layers.{i}.feed_forward.experts.{proj}"] = [
                f"model.layers.{i}.{_moe_module(name)}.experts.{e}.{theirs}.weight" for e in range(args.moe.n_experts)]
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
        if name == "mixtral":  # transformers 5's in-memory names (mlp.gate, mlp.experts.gate_up_proj, ...)
            key = key.replace(".mlp.gate.", ".block_sparse_moe.gate.").replace(".mlp.experts.",
                                                                                ".block_sparse_moe.experts.")
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
    for key, parts in _stacked(name, args).items():
        if key not in tensors:
            missing.append(key)
            continue
        fused = tensors.pop(key)
        want = [sum(rows for _, rows in parts), args.dim]
        if list(fused.shape) != want:
            raise HFFormatError(f"{_tensor_file(where, key)}: {key} has shape {list(fused.shape)}, but "
                                f"{_config_file(where)} implies {want}")
        for (ours, _), part in zip(parts, fused.split([rows for _, rows in parts])):
            out[ours] = part.clone()
    out.update(_experts_from_hf(name, args, tensors, missing))
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


def _experts_from_hf(name: str, args: TransformerArgs, tensors: dict[str, torch.Tensor], missing: list[str]) -> dict:
    """The stacked expert weights, from one tensor per expert (checkpoints) or from transformers 5's in-memory
    `experts.gate_up_proj` (E, 2 x hidden, dim: gate rows first) and `experts.down_proj` (a model's state_dict).
    Tensors used are popped from `tensors`; absent ones are added to `missing`."""
    out = {}
    for ours, keys in _expert_stacks(name, args).items():
        layer = ours.split(".")[1]
        fused = f"model.layers.{layer}.{_moe_module(name)}.experts."
        if ours.endswith("down_proj") and fused + "down_proj" in tensors:
            out[ours] = tensors.pop(fused + "down_proj")
        elif fused + "gate_up_proj" in tensors:
            gate_up = tensors[fused + "gate_up_proj"]
            gate, up = gate_up.chunk(2, dim=1)
            out[ours] = (gate if ours.endswith("gate_proj") else up).clone()
            if ours.endswith("up_proj"):
                del tensors[fused + "gate_up_proj"]
        elif all(key in tensors for key in keys):
            out[ours] = torch.stack([tensors.pop(key) for key in keys])
        else:
            missing.extend(key for key in keys if key not in tensors)
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
    for key, parts in _stacked(name, args).items():
        out[key] = torch.cat([state.pop(ours) for ours, _ in parts])
    for ours, keys in _expert_stacks(name, args).items():
        out.update(zip(keys, state.pop(ours).unbind(0)))
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
