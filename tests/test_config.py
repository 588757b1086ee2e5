"""The config tree: precedence of its sources, strict keys, error messages, validation and round-trips.

Every `load_config` call passes `environ` explicitly so that the host environment never leaks in.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from maester.config import Config, ConfigError, load_config
from maester.config.sources import parse_cli_overrides, parse_value

DEMO = Path(__file__).parents[1] / "configs" / "demo.toml"
DEMO_FILE = tomllib.loads(DEMO.read_text())  # what the file says, independent of the loader under test

# The file layer of the precedence tests: steps/seed differ from the defaults (1000/0), lr from the default.
FILE_TREE = {
    "training": {"steps": 100, "seed": 5, "global_batch_size": 16, "micro_batch_size": 4},
    "optimizer": {"lr": 0.01, "weight_decay": 0.05},
}


def _write(path: Path, tree: dict) -> Path:
    if path.suffix == ".toml":
        lines = []
        for section, values in tree.items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        path.write_text("\n".join(lines) + "\n")
    elif path.suffix in (".yaml", ".yml"):
        path.write_text(yaml.safe_dump(tree))
    else:
        path.write_text(json.dumps(tree))
    return path


@pytest.fixture(params=["toml", "yaml", "json"])
def config_file(request, tmp_path) -> Path:
    path = _write(tmp_path / f"run.{request.param}", FILE_TREE)
    if request.param == "toml":  # the writer above is ad hoc: make sure it wrote what we meant
        assert tomllib.loads(path.read_text()) == FILE_TREE
    return path


def _error(path, overrides=(), environ=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), environ={} if environ is None else environ)
    return str(info.value)


# ---------------------------------------------------------------- precedence


def test_defaults_without_a_file():
    cfg = load_config(None, [], environ={})
    assert cfg == Config()
    assert cfg.training.steps == 1000 and cfg.training.seed == 0 and cfg.optimizer.lr == 3e-4


def test_file_overrides_defaults_and_defaults_survive(config_file):
    cfg = load_config(config_file, [], environ={})
    assert cfg.training.steps == 100
    assert cfg.training.seed == 5
    assert cfg.optimizer.lr == 0.01
    assert cfg.optimizer.weight_decay == 0.05
    # Keys the file does not set keep their defaults, including in sections the file does set.
    assert cfg.training.batch_unit == "sequences"
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.logging.interval == 10
    assert cfg.model == Config().model


def test_environment_overrides_file_and_file_keys_survive(config_file):
    environ = {"MAESTER_TRAINING__STEPS": "50", "MAESTER_OPTIMIZER__LR": "0.02", "UNRELATED": "x"}
    cfg = load_config(config_file, [], environ=environ)
    assert cfg.training.steps == 50
    assert cfg.optimizer.lr == 0.02
    assert cfg.training.seed == 5  # file only
    assert cfg.optimizer.weight_decay == 0.05  # file only
    assert cfg.logging.interval == 10  # default only


@pytest.mark.parametrize("form", [["--training.steps=10"], ["--training.steps", "10"]], ids=["equals", "space"])
def test_command_line_overrides_environment_and_lower_keys_survive(config_file, form):
    environ = {"MAESTER_TRAINING__STEPS": "50", "MAESTER_OPTIMIZER__LR": "0.02"}
    cfg = load_config(config_file, form, environ=environ)
    assert cfg.training.steps == 10
    assert cfg.optimizer.lr == 0.02  # environment only
    assert cfg.training.seed == 5  # file only
    assert cfg.logging.interval == 10  # default only


def test_command_line_overrides_file_without_environment(config_file):
    cfg = load_config(config_file, ["--training.seed", "9", "--optimizer.lr=0.5"], environ={})
    assert (cfg.training.seed, cfg.optimizer.lr, cfg.training.steps) == (9, 0.5, 100)


def test_later_command_line_override_wins():
    cfg = load_config(DEMO, ["--training.steps=300", "--training.steps", "400"], environ={})
    assert cfg.training.steps == 400


def test_environment_is_not_read_when_environ_is_given(monkeypatch):
    monkeypatch.setenv("MAESTER_TRAINING__STEPS", "77")
    assert load_config(DEMO, [], environ={}).training.steps == DEMO_FILE["training"]["steps"]
    assert load_config(DEMO, []).training.steps == 77  # environ=None: the process environment


def test_nested_environment_and_command_line_keys():
    environ = {"MAESTER_MODEL__OVERRIDES__N_LAYERS": "3", "MAESTER_DATA__SOURCES__0__TEXT_COLUMN": "body"}
    cfg = load_config(DEMO, ["--data.sources.0.format", "jsonl"], environ=environ)
    assert cfg.model.overrides == {"n_layers": 3}
    assert cfg.data.sources[0].path == "builtin:pydoc"  # from the file
    assert cfg.data.sources[0].text_column == "body"
    assert cfg.data.sources[0].format == "jsonl"


def test_json_values_on_the_command_line():
    cfg = load_config(DEMO, ['--data.sources=[{"path": "a.parquet"}, {"path": "b.jsonl", "format": "jsonl"}]',
                             "--optimizer.betas=[0.8, 0.99]", "--training.max_grad_norm=null"], environ={})
    assert [s.path for s in cfg.data.sources] == ["a.parquet", "b.jsonl"]
    assert cfg.data.sources[1].format == "jsonl"
    assert cfg.optimizer.betas == (0.8, 0.99)
    assert cfg.training.max_grad_norm is None


def test_file_list_replaces_default_list(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  sources:\n    - path: one.parquet\n    - path: two.parquet\n      text_column: t\n")
    cfg = load_config(path, [], environ={})
    assert [(s.path, s.text_column) for s in cfg.data.sources] == [("one.parquet", "text"), ("two.parquet", "t")]


def test_empty_value_is_a_string_not_json():
    # An empty value is an (empty) string, like any other value that does not start with '[' or '{'.
    assert parse_value("") == ""
    assert load_config(DEMO, ["--job.dump_dir="], environ={}).job.dump_dir == ""
    message = _error(DEMO, ["--training.steps="])
    assert "training.steps" in message and "''" in message and "JSON" not in message


def test_parse_cli_overrides_forms_and_errors():
    assert parse_cli_overrides(["--a.b=1", "--c.d", "2", "--e.f=x=y"]) == [("a.b", "1"), ("c.d", "2"), ("e.f", "x=y")]
    with pytest.raises(ConfigError, match="has no value"):
        parse_cli_overrides(["--training.steps"])
    with pytest.raises(ConfigError, match="has no value"):
        parse_cli_overrides(["--training.steps", "--training.seed=1"])
    with pytest.raises(ConfigError, match="dotted"):
        parse_cli_overrides(["--steps=1"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_cli_overrides(["steps=1"])


# ---------------------------------------------------------------- unknown keys


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nstepz = 3\n")
    message = _error(path)
    assert "training.stepz" in message
    assert "did you mean 'steps'" in message
    assert str(path) in message


def test_unknown_section_in_file(tmp_path):
    path = _write(tmp_path / "c.json", {"trainng": {"steps": 3}})
    message = _error(path)
    assert "trainng: unknown key" in message
    assert "did you mean 'training'" in message


def test_unknown_key_in_environment():
    message = _error(DEMO, environ={"MAESTER_TRAINING__STEPZ": "3"})
    assert "training.stepz" in message
    assert "did you mean 'steps'" in message
    assert "environment variable MAESTER_TRAINING__STEPZ" in message


def test_every_maester_variable_the_docs_and_messages_name_is_a_switch_or_config():
    """Each `MAESTER_*` variable that README.md, docs/ or a message of the package names does what it says: a
    switch of the program (`MAESTER_NO_JOB_LOCK=1`) is never read as config; a config variable sets its key (with
    the value the text gives it, `VAR=value`). A variable that is neither is an error naming it."""
    import re

    from maester.config.sources import SWITCHES

    repo = Path(__file__).resolve().parents[1]
    texts = [repo / "README.md", *sorted((repo / "docs").glob("*.md")), *sorted((repo / "src").rglob("*.py"))]
    named: dict[str, str | None] = {}
    for path in texts:
        for m in re.finditer(r"(?<![\w])(MAESTER_[A-Z0-9]+(?:_{1,2}[A-Z0-9]+)*)(?:=(\w+))?", path.read_text()):
            named[m[1]] = named.get(m[1]) or m[2]
    assert "MAESTER_NO_JOB_LOCK" in named and "MAESTER_TRAINING__STEPS" in named, sorted(named)
    for name, value in sorted(named.items()):
        if name in SWITCHES:
            assert load_config(None, [], environ={name: "1"}) == load_config(None, [], environ={}), name
        else:
            assert "__" in name, f"{name} is named in the docs but is neither a switch nor a config variable"
            key = name.removeprefix("MAESTER_").lower().split("__")
            cfg = load_config(None, [], environ={name: value or "1"}).model_dump()
            for part in key:
                cfg = cfg[part]
            assert str(cfg) == (value or "1"), name
    message = _error(DEMO, environ={"MAESTER_NO_JOB_LOKC": "1"})
    assert "MAESTER_NO_JOB_LOKC is neither a config variable" in message and "MAESTER_NO_JOB_LOCK" in message


def test_unknown_key_on_command_line():
    message = _error(DEMO, ["--training.sead", "1"])
    assert "training.sead" in message
    assert "did you mean 'seed'" in message
    assert "command line --training.sead" in message


def test_unknown_key_without_close_match_lists_the_choices():
    message = _error(DEMO, ["--optimizer.learning_rate=0.1"])
    assert "optimizer.learning_rate: unknown key" in message
    assert "choices: 'name', 'lr'" in message
    assert "command line --optimizer.learning_rate" in message


def test_unknown_nested_key_in_list_on_command_line():
    message = _error(DEMO, ["--data.sources.0.pth=x.parquet"])
    assert "data.sources.0.pth" in message
    assert "did you mean 'path'" in message
    assert "command line --data.sources.0.pth" in message


def test_unknown_nested_key_in_list_in_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[data]\nsources = [{ path = "a" }, { path = "b", text_colum = "t" }]\n')
    message = _error(path)
    assert "data.sources.1.text_colum" in message
    assert "did you mean 'text_column'" in message
    assert str(path) in message


def test_list_index_out_of_range_on_command_line():
    message = _error(DEMO, ["--data.sources.3.path=x"])
    assert "data.sources" in message and "'3'" in message


def test_unknown_model_override_on_command_line():
    message = _error(DEMO, ["--model.overrides.dimm=128"])
    assert "model.overrides.dimm" in message
    assert "did you mean 'dim'" in message
    assert "command line --model.overrides.dimm" in message


def test_unknown_model_override_in_environment_and_file(tmp_path):
    message = _error(DEMO, environ={"MAESTER_MODEL__OVERRIDES__N_LAYER": "2"})
    assert "model.overrides.n_layer" in message
    assert "did you mean 'n_layers'" in message
    assert "environment variable MAESTER_MODEL__OVERRIDES__N_LAYER" in message

    path = tmp_path / "c.toml"
    path.write_text('[model]\noverrides = { n_head = 4 }\n')
    message = _error(path)
    assert "model.overrides.n_head" in message and "did you mean 'n_heads'" in message
    assert str(path) in message


def test_unknown_model_name_and_flavor():
    message = _error(DEMO, ["--model.name=lama"])
    assert "model.name 'lama'" in message and "did you mean 'llama'" in message
    message = _error(DEMO, ["--model.flavor=dem"])
    assert "model.flavor 'dem'" in message and "did you mean 'demo'" in message


# ---------------------------------------------------------------- bad values


def test_bad_value_on_command_line():
    message = _error(DEMO, ["--training.steps=abc"])
    assert "training.steps" in message
    assert "'abc'" in message
    assert "command line --training.steps" in message


def test_bad_value_in_environment():
    message = _error(DEMO, environ={"MAESTER_OPTIMIZER__LR": "fast"})
    assert "optimizer.lr" in message
    assert "'fast'" in message
    assert "environment variable MAESTER_OPTIMIZER__LR" in message


def test_bad_value_in_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  precision: fp8\n")
    message = _error(path)
    assert "training.precision" in message and "'fp8'" in message and str(path) in message


@pytest.mark.parametrize("override, key, value", [
    ("--training.steps=0", "training.steps", "0"),
    ("--optimizer.lr=-1", "optimizer.lr", "'-1'"),
    ("--data.seq_len=-5", "data.seq_len", "'-5'"),
    ("--schedule.min_lr_ratio=2", "schedule.min_lr_ratio", "'2'"),
    ("--training.batch_unit=samples", "training.batch_unit", "'samples'"),
    ("--parallel.dp_shard=0", "parallel.dp_shard", "0"),
])
def test_bad_values_name_key_and_value(override, key, value):
    message = _error(DEMO, [override])
    assert key in message
    assert value in message


def test_invalid_json_value():
    message = _error(DEMO, ["--optimizer.betas=[0.9,"])
    assert "optimizer.betas" in message and "'[0.9,'" in message and "command line" in message


def test_bracket_glob_stays_a_string(tmp_path):
    """A value that only looks like JSON (a glob with a character class) reaches the field as text."""
    cfg = load_config(DEMO, ["--data.sources.0.path=data/[ab]*.parquet"], environ={})
    assert cfg.data.sources[0].path == "data/[ab]*.parquet"


def test_cross_section_error_names_where_each_value_came_from():
    message = _error(DEMO, ["--training.micro_batch_size=5"])
    assert "training.micro_batch_size from command line --training.micro_batch_size" in message


# ---------------------------------------------------------------- files


def test_missing_config_file_is_an_error(tmp_path):
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(missing, [], environ={})
    assert str(missing) in str(info.value)


def test_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(tmp_path, [], environ={})


def test_malformed_toml_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[training]\nsteps = = 3\n")
    message = _error(path)
    assert str(path) in message and "cannot parse" in message


@pytest.mark.parametrize("name, text", [("broken.yaml", "training: [unclosed\n"), ("broken.json", '{"training": ')])
def test_malformed_yaml_and_json_name_the_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    message = _error(path)
    assert str(path) in message and "cannot parse" in message


def test_unknown_suffix_and_non_mapping_top_level(tmp_path):
    ini = tmp_path / "c.ini"
    ini.write_text("[training]\nsteps=3\n")
    assert "unknown format" in _error(ini)
    listing = tmp_path / "c.json"
    listing.write_text("[1, 2]")
    assert "top level must be a table/mapping" in _error(listing)


def test_empty_yaml_file_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path, [], environ={}) == Config()


# ---------------------------------------------------------------- cross-field validation


def test_micro_batch_must_divide_global_batch():
    message = _error(DEMO, ["--training.micro_batch_size=5"])
    assert "training.global_batch_size (16)" in message and "training.micro_batch_size (5)" in message
    assert load_config(DEMO, ["--training.micro_batch_size=4"], environ={}).training.micro_batch_size == 4


def test_tokens_unit_must_be_a_multiple_of_seq_len():
    message = _error(DEMO, ["--training.batch_unit=tokens"])  # 16 tokens, seq_len 256
    assert "training.global_batch_size = 16 tokens" in message and "data.seq_len = 256" in message
    message = _error(DEMO, ["--training.batch_unit=tokens", "--training.global_batch_size=1024",
                            "--training.micro_batch_size=128"])
    assert "training.micro_batch_size = 128 tokens" in message
    cfg = load_config(DEMO, ["--training.batch_unit=tokens", "--training.global_batch_size=1024",
                             "--training.micro_batch_size=512"], environ={})
    assert cfg.sequences(cfg.training.global_batch_size) == 4
    assert cfg.sequences(cfg.training.micro_batch_size) == 2


def test_a_shipped_config_shortens_with_training_steps_alone():
    """The demo warms up for 20 steps; `--training.steps=3` (or MAESTER_TRAINING__STEPS) is enough to shorten it:
    the schedule clamps the warmup (tests/train/test_schedule.py), the config does not refuse it."""
    assert DEMO_FILE["schedule"]["warmup_steps"] > 3
    assert load_config(DEMO, ["--training.steps=3"], environ={}).training.steps == 3
    assert load_config(DEMO, [], environ={"MAESTER_TRAINING__STEPS": "10"}).training.steps == 10
    message = _error(DEMO, ["--schedule.warmup_fraction=0.1"])
    assert "schedule.warmup_steps = 20 and schedule.warmup_fraction = 0.1: set one of them" in message


@pytest.mark.parametrize("key", ["path", "bos_token", "eos_token", "pad_token"])
def test_byte_tokenizer_rejects_path_and_special_tokens(key):
    message = _error(DEMO, [f"--tokenizer.{key}=x"])
    assert f"tokenizer.{key} must not be set" in message and "byte" in message


def test_hf_tokenizer_requires_a_path():
    assert "tokenizer.path is required" in _error(DEMO, ["--tokenizer.kind=hf"])
    cfg = load_config(DEMO, ["--tokenizer.kind=hf", "--tokenizer.path=tok/tokenizer.json"], environ={})
    assert cfg.tokenizer.path == "tok/tokenizer.json"


@pytest.mark.parametrize("name", ["a/b", "../x", ".hidden", "", "a b"])
def test_job_name_rejects_slashes_and_odd_characters(name):
    message = _error(DEMO, [f"--job.name={name}"])
    assert "job.name" in message and repr(name) in message


def test_job_name_accepts_plain_names(tmp_path):
    cfg = load_config(DEMO, ["--job.name=run-1_v2.0", f"--job.dump_dir={tmp_path}"], environ={})
    assert cfg.job_dir == tmp_path / "run-1_v2.0"


# ---------------------------------------------------------------- model.overrides


def test_model_overrides_are_typed():
    cfg = load_config(DEMO, ["--model.overrides.dim=128", "--model.overrides.n_heads", "4",
                             "--model.overrides.norm_eps=1e-6", "--model.overrides.tie_embeddings=true"],
                      environ={})
    overrides = cfg.model.overrides
    assert overrides == {"dim": 128, "n_heads": 4, "norm_eps": 1e-6, "tie_embeddings": True}
    assert type(overrides["dim"]) is int and type(overrides["n_heads"]) is int
    assert type(overrides["norm_eps"]) is float and type(overrides["tie_embeddings"]) is bool
    args = cfg.model.architecture()
    assert (args.dim, args.n_heads, args.n_kv_heads, args.n_layers) == (128, 4, 2, 4)  # others from the flavor
    assert json.loads(cfg.to_json())["model"]["overrides"]["dim"] == 128


def test_model_overrides_nested_model_is_filled_in():
    cfg = load_config(DEMO, ['--model.overrides.rope_scaling={"factor": 4}'], environ={})
    assert cfg.model.overrides["rope_scaling"] == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert cfg.model.architecture().rope_scaling.factor == 4.0


@pytest.mark.parametrize("overrides, fragment", [
    (["--model.overrides.dim=128"], "dim (128) must be divisible by n_heads (6)"),
    (["--model.overrides.n_kv_heads=4"], "n_heads (6) must be a multiple of n_kv_heads (4)"),
    (["--model.overrides.n_layers=0"], "n_layers must be positive"),
    (["--model.overrides.head_dim=33"], "rotary dims (head_dim 33 x rotary_fraction 1.0) must be positive and even"),
    (["--model.overrides.dim=big"], "model.overrides.dim"),
])
def test_invalid_architecture_is_rejected_naming_model_overrides(overrides, fragment):
    message = _error(DEMO, overrides)
    assert "model.overrides" in message
    assert fragment in message


def test_model_overrides_from_file_replace_not_merge(tmp_path):
    # A file's model.overrides table replaces the (empty) default; the command line can add to it.
    path = tmp_path / "c.toml"
    path.write_text(DEMO.read_text().replace('flavor = "demo"', 'flavor = "demo"\noverrides = { n_layers = 2 }'))
    cfg = load_config(path, ["--model.overrides.max_seq_len=512"], environ={})
    assert cfg.model.overrides == {"n_layers": 2, "max_seq_len": 512}


# ---------------------------------------------------------------- config.json round trip


def _round_trips(cfg: Config, tmp_path: Path) -> None:
    text = cfg.to_json()
    assert Config.model_validate_json(text) == cfg
    path = tmp_path / "config.json"
    path.write_text(text)
    again = Config.from_json_file(path)
    assert again == cfg
    assert again.to_json() == text  # stable: a second trip changes nothing
    assert load_config(path, [], environ={}) == cfg


def test_demo_config_round_trips(tmp_path):
    cfg = load_config(DEMO, [], environ={})
    # The demo file's values, not the defaults.
    expected = (DEMO_FILE["training"]["steps"], DEMO_FILE["data"]["seq_len"], DEMO_FILE["schedule"]["name"],
                DEMO_FILE["optimizer"]["lr"])
    assert (cfg.training.steps, cfg.data.seq_len, cfg.schedule.name, cfg.optimizer.lr) == expected
    _round_trips(cfg, tmp_path)


def test_config_with_overrides_round_trips(tmp_path):
    cfg = load_config(DEMO, [
        "--model.overrides.dim=128", "--model.overrides.n_heads=4",
        '--model.overrides.rope_scaling={"factor": 2.5}',
        '--data.sources=[{"path": "a.parquet"}, {"path": "b/*.jsonl", "format": "jsonl", "text_column": "body"}]',
        "--optimizer.betas=[0.85, 0.975]",
        "--training.max_grad_norm=null", "--checkpoint.keep_every=1000", "--job.name=rt",
    ], environ={"MAESTER_TRAINING__SEED": "17"})
    assert cfg.optimizer.betas == (0.85, 0.975) and isinstance(cfg.optimizer.betas, tuple)
    assert len(cfg.data.sources) == 2 and cfg.training.seed == 17
    _round_trips(cfg, tmp_path)


def test_from_json_file_ignores_the_environment(tmp_path, monkeypatch):
    cfg = load_config(DEMO, [], environ={})
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    monkeypatch.setenv("MAESTER_TRAINING__STEPS", "3")
    assert Config.from_json_file(path) == cfg


def test_from_json_file_is_strict(tmp_path):
    tree = json.loads(load_config(DEMO, [], environ={}).to_json())
    tree["training"]["stepz"] = 3
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tree))
    with pytest.raises(ConfigError, match="training.stepz"):
        Config.from_json_file(path)
    with pytest.raises(ConfigError, match="does not exist"):
        Config.from_json_file(tmp_path / "nope" / "config.json")


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs").rglob("*.toml")),
                         ids=lambda p: p.relative_to(Path(__file__).parents[1] / "configs").as_posix())
def test_every_shipped_config_resolves(path):
    if path.parent.name == "sweeps":  # a sweep file: every point's config
        from maester.jobs.sweep import expand

        spec, points = expand(path)
        assert points
        for point in points:
            cfg = load_config(path.parent / spec["base"], point["overrides"], environ={})
            assert Config.model_validate_json(cfg.to_json()) == cfg
        return
    cfg = load_config(path, environ={})
    assert Config.model_validate_json(cfg.to_json()) == cfg  # and round-trips



def test_the_package_names_every_section_and_imports_the_tree_only_on_use():
    import maester.config

    for name in maester.config.__all__:
        getattr(maester.config, name)  # each exported name resolves from its module
    assert set(maester.config.__all__) <= set(dir(maester.config))
    # the models import the sections' base class, and the tree imports the models: the base must not pull the tree
    code = ("import sys, maester.config.base, maester.models; "
            "assert 'maester.config.tree' not in sys.modules, sorted(m for m in sys.modules if 'maester' in m)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
