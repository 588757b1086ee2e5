"""Named architectures and their flavors. Importing this module does not import torch."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from maester.models.llama_args import LLAMA_FLAVORS, LlamaArgs


@dataclass(frozen=True)
class Architecture:
    args_class: type[BaseModel]
    flavors: dict[str, BaseModel]
    builder: str  # "module:Class", imported only when a model is built

    def model_class(self) -> Any:
        module, name = self.builder.split(":")
        return getattr(importlib.import_module(module), name)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(LlamaArgs, LLAMA_FLAVORS, "maester.models.llama:Llama"),
}
