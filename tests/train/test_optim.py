import torch

from maester.config import ModelConfig, OptimizerConfig
from maester.models.build import build_on_meta, materialize, resolve_args
from maester.train.optim import build_optimizer


def test_weight_decay_only_on_matrices_not_embeddings_or_norms():
    cfg = ModelConfig(flavor="tiny")
    model = materialize(build_on_meta(cfg, resolve_args(cfg, 269)), torch.device("cpu"), 0)
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1), torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: g for g in opt.param_groups}
    decayed = {names[id(p)] for p in groups["decay"]["params"]}
    plain = {names[id(p)] for p in groups["no_decay"]["params"]}
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert "tok_embeddings.weight" in plain and "norm.weight" in plain
    assert "layers.0.attention_norm.weight" in plain
    assert "layers.0.attention.q_proj.weight" in decayed and "output.weight" in decayed
    assert decayed | plain == set(names.values()) and not decayed & plain
    assert opt.defaults["foreach"] and not opt.defaults["fused"]
