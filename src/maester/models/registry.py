"""Named architectures and their flavors. Importing this module does not import torch."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from maester.models.args import TransformerArgs
from maester.models.flavors import (
    GEMMA2_FLAVORS,
    GEMMA3_FLAVORS,
    GPT_NEOX_FLAVORS,
    LLAMA_FLAVORS,
    MISTRAL_FLAVORS,
    MIXTRAL_FLAVORS,
    OLMO2_FLAVORS,
    OLMOE_FLAVORS,
    PHI3_FLAVORS,
    QWEN2_FLAVORS,
    QWEN3_FLAVORS,
    QWEN3_MOE_FLAVORS,
)


@dataclass(frozen=True)
class Architecture:
    args_class: type[BaseModel]
    flavors: dict[str, BaseModel]
    builder: str  # "module:Class", imported only when a model is built

    def model_class(self) -> Any:
        module, name = self.builder.split(":")
        return getattr(importlib.import_module(module), name)


_TRANSFORMER = "maester.models.transformer:Transformer"
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(TransformerArgs, LLAMA_FLAVORS, _TRANSFORMER),
    "mistral": Architecture(TransformerArgs, MISTRAL_FLAVORS, _TRANSFORMER),
    "gemma2": Architecture(TransformerArgs, GEMMA2_FLAVORS, _TRANSFORMER),
    "gemma3": Architecture(TransformerArgs, GEMMA3_FLAVORS, _TRANSFORMER),
    "qwen2": Architecture(TransformerArgs, QWEN2_FLAVORS, _TRANSFORMER),
    "qwen3": Architecture(TransformerArgs, QWEN3_FLAVORS, _TRANSFORMER),
    "olmo2": Architecture(TransformerArgs, OLMO2_FLAVORS, _TRANSFORMER),
    "phi3": Architecture(TransformerArgs, PHI3_FLAVORS, _TRANSFORMER),
    "gpt_neox": Architecture(TransformerArgs, GPT_NEOX_FLAVORS, _TRANSFORMER),
    "olmoe": Architecture(TransformerArgs, OLMOE_FLAVORS, _TRANSFORMER),
    "qwen3_moe": Architecture(TransformerArgs, QWEN3_MOE_FLAVORS, _TRANSFORMER),
    "mixtral": Architecture(TransformerArgs, MIXTRAL_FLAVORS, _TRANSFORMER),
}
