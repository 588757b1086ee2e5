"""The config tree of a run, one module per family of sections (`tree` assembles them; the model's own sections
live beside the models). How a value flows, in `sources.load`: the defaults, then a file (TOML, YAML or JSON), then
`MAESTER_<SECTION>__<KEY>` environment variables (a `.env` in the working directory only fills variables the
environment lacks), then `--section.key=value` on the command line; unknown keys are named with their origin, then
the sections and the checks across them validate the tree; the job directory saves it whole as `config.json`
(`jobs.job_dir`), as does every checkpoint.

Names are imported from their modules on first use: `maester.models` imports `base`, and the tree imports the
models, so importing this package must not import the tree."""

from __future__ import annotations

import importlib

_HOMES = {
    "base": ("ConfigError", "Section"),
    "checkpoint": ("CheckpointConfig", "HF_PREFIX", "LOAD_MODES", "PARTIAL_LOAD_MODES"),
    "data": ("DataConfig", "DataSourceConfig", "SFTConfig", "TokenizerConfig"),
    "job": ("JobConfig", "SlurmConfig"),
    "observability": ("EvaluationConfig", "LoggingConfig", "PreflightConfig", "ProfilingConfig", "TensorBoardConfig",
                      "WandbConfig"),
    "optim": ("DECOUPLED_DECAY", "OPTIMIZER_NAMES", "MuonConfig", "OptimizerConfig", "ParamGroupRule",
              "ScheduleConfig"),
    "training": ("Float8Config", "ParallelConfig", "TrainingConfig"),
    "tree": ("Config", "load_config"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
_MODELS = {"ModelConfig": "maester.models.config", "MupConfig": "maester.models.args"}  # sections of the tree, too

__all__ = sorted([*_HOME_OF, *_MODELS])


def __getattr__(name: str) -> object:
    if name in _HOME_OF:
        module = importlib.import_module(f"{__name__}.{_HOME_OF[name]}")
    elif name in _MODELS:
        module = importlib.import_module(_MODELS[name])
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # the next look-up does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
