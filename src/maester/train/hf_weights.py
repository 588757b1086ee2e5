"""A run that starts from the weights of a Hugging Face model directory (`checkpoint.init_from = "hf:PATH"`, or
`hf:org/name[@revision]`, a Hub id fetched into the Hugging Face cache): check that the directory's architecture is
the run's, read it on rank 0 and hand each rank its shards."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)



# Fields an `hf:` source may differ in from the run's model: the attention kernel, the init of weights that are
# loaded anyway, and the context length the run trains at.
_HF_FREE_FIELDS = ("attention", "init_std", "max_seq_len")


def hf_architecture_differences(name: str, args, hf_name: str, hf_args) -> list[str]:
    """How the run's model (architecture `name`, `args`) differs from an HF directory's; empty when its weights
    fit. The head dimension is compared resolved; the vocabulary must be the same size."""
    out = [] if name == hf_name else [f"architecture (run {name}, HF {hf_name})"]
    return out + [f"{key} (run {ours!r}, HF {theirs!r})"
                  for key, (ours, theirs) in args.differences(hf_args, ignore=_HF_FREE_FIELDS).items()]


def fetch_before_process_group(source: str) -> None:
    """Bring a Hub id's files (`checkpoint.init_from = "hf:org/name"`) into the Hugging Face cache now, before the
    process group exists: local rank 0 of each node downloads under the cache's file lock and the other local
    ranks wait on that lock (`maester.hub`), as for the tokenizer. Fetched later, by rank 0 inside
    `load_hf_weights`, a download longer than `training.init_timeout_seconds` would end the other ranks' wait in a
    collective timeout. A local directory is left alone."""
    from maester.hub import local_path

    local_path(source, "checkpoint.init_from")


def load_hf_weights(path: str | Path, model: nn.Module, name: str, where: str) -> None:
    """Load the weights of the HF model directory `path` into `model` (architecture `name`), which may be sharded
    (FSDP, TP). With several processes only rank 0 reads the directory; the tensors are broadcast and each rank keeps
    its shards, and rank 0's error is raised on every rank. A Hub id is read from the cache, where
    `fetch_before_process_group` put it. The directory's config.json must describe `model.args`
    (`hf_architecture_differences`); `where` names the setting that asked, for the error."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
    if not distributed:
        set_model_state_dict(model, _read_hf_state(path, model, name, where),
                             options=StateDictOptions(full_state_dict=True, strict=True))
        return
    state, error = {}, None
    if torch.distributed.get_rank() == 0:
        try:
            state = _read_hf_state(path, model, name, where)
        except Exception as e:  # raised below, after every rank has heard of it
            error = e
    # a refusal (ValueError: another architecture) is the same refusal on every rank; anything else is named
    outcome = [None if error is None else (isinstance(error, ValueError), f"{type(error).__name__}: {error}",
                                           str(error))]
    torch.distributed.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[0] is not None:
        refused, named, message = outcome[0]
        raise ValueError(message) if refused else RuntimeError(f"{where}: rank 0 could not load {path}: {named}")
    set_model_state_dict(model, state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True))


def _read_hf_state(path: str | Path, model: nn.Module, name: str, where: str) -> dict[str, torch.Tensor]:
    """The full state dict of `model` from the HF directory `path`, in the model's dtypes."""
    from maester.hub import local_path
    from maester.models.hf import read_hf_config, transformer_args_from_hf
    from maester.models.hf_tensors import read_hf_tensors, state_dict_from_hf

    path = local_path(str(path), "checkpoint.init_from")
    hf_name, hf_args = transformer_args_from_hf(read_hf_config(path), str(path / "config.json"))
    differing = hf_architecture_differences(name, model.args, hf_name, hf_args)
    if differing:
        raise ValueError(f"{where}: the run's model differs from {path / 'config.json'} in {'; '.join(differing)}: "
                         f"set model.hf_config = \"{path}\" to take the architecture from it")
    state = state_dict_from_hf(hf_name, hf_args, read_hf_tensors(path), where=str(path))
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    return {k: v.to(dtypes[k]) if k in dtypes else v for k, v in state.items()}
