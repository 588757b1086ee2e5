"""A Hugging Face model directory as maester reads it: what makes one (`is_hf_model_dir`) and the tokenizer and
data settings that make maester tokenize as its tokenizer files do (`hf_tokenizer_settings`). Used by `convert`
and `generate`, which do not import each other for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from maester.data.tokenizers import token_content
from maester.files import read_json_object


def is_hf_model_dir(path: str | Path) -> bool:
    """An HF model directory: config.json and safetensors weights (one file or an index of shards)."""
    path = Path(path)
    return (path / "config.json").is_file() and any(
        (path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))


def hf_tokenizer_settings(tokenizer_dir: Path, hf: dict) -> dict[str, Any]:
    """The `tokenizer` and `data` sections that make maester tokenize as the HF tokenizer files in `tokenizer_dir`
    do: kind `hf`; BOS/EOS/pad from tokenizer_config.json, else from the ids in the model's config.json `hf`;
    `data.add_bos` when the HF tokenizer puts BOS before a text itself; and `data.sft.template = "jinja"` when it
    ships a chat template."""
    from tokenizers import Tokenizer

    file = tokenizer_dir / "tokenizer.json"
    try:
        raw = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust parser's message names what is wrong
        raise ValueError(f"{file}: not a tokenizer.json the tokenizers library reads: {e}") from None
    config_file = tokenizer_dir / "tokenizer_config.json"
    config = read_json_object(config_file) if config_file.is_file() else {}
    model_config = {**hf.get("text_config", {}), **hf}
    tokenizer: dict[str, Any] = {"kind": "hf", "path": str(tokenizer_dir)}
    tokens: dict[str, str | None] = {}
    for key in ("bos", "eos", "pad"):
        tokens[key] = token_content(config.get(f"{key}_token"))
        tid = model_config.get(f"{key}_token_id")
        tid = tid[0] if isinstance(tid, list) and tid else tid
        if tokens[key] is None and isinstance(tid, int):
            tokens[key] = raw.id_to_token(tid)
            if tokens[key] is None:
                raise ValueError(f"{tokenizer_dir / 'config.json'}: {key}_token_id {tid} is not in the vocabulary "
                                 f"of {file}")
            tokenizer[f"{key}_token"] = tokens[key]
    data: dict[str, Any] = {"add_bos": _adds_bos(raw, config, tokens["bos"])}
    if "chat_template" in config or (tokenizer_dir / "chat_template.jinja").is_file():
        data["sft"] = {"template": "jinja"}
    return {"tokenizer": tokenizer, "data": data}


def _adds_bos(raw, config: dict, bos: str | None) -> bool:
    """Whether the HF tokenizer starts every text with BOS: tokenizer_config.json's `add_bos_token`, else what its
    post-processor does to a text."""
    if isinstance(config.get("add_bos_token"), bool):
        return config["add_bos_token"]
    bos_id = raw.token_to_id(bos) if bos else None
    return bos_id is not None and raw.encode("a").ids[:1] == [bos_id]
