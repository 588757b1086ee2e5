"""Where a config's values come from, in rising precedence: defaults < a file (TOML, YAML or JSON) < environment
variables (`MAESTER_TRAINING__STEPS=10`) < command-line overrides (`--training.steps=10` or `--training.steps 10`);
merged into one tree whose unknown keys are named with their origin before the schema validates it."""

from __future__ import annotations

import json
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from maester.config.base import ConfigError, format_pydantic_error, origin_of, suggest

ENV_PREFIX = "MAESTER_"
NO_JOB_LOCK = "MAESTER_NO_JOB_LOCK"
SWITCHES = {NO_JOB_LOCK: "1: train without the one-run-per-job lock, on a filesystem that has no file locks"}
"""The program's own `MAESTER_*` switches: never config. A config variable names a key under a section, so it always
holds a double underscore (`MAESTER_TRAINING__STEPS`); any other `MAESTER_*` variable is an error."""
Schema = TypeVar("Schema", bound=BaseModel)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML, YAML or JSON file into a dict; a missing or malformed file is an error."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist" if not path.exists() else
                          f"config file {path} is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text) or {}
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: unknown format {suffix!r} (use .toml, .yaml, .yml or .json)")
    except ConfigError:
        raise
    except Exception as e:  # the parsers' messages carry line and column
        raise ConfigError(f"config file {path}: cannot parse: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a table/mapping, got {type(data).__name__}")
    return data


def parse_cli_overrides(args: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """`--a.b=1` and `--a.b 1` into (dotted key, raw value) pairs."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            key = arg[2:]
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"override --{key} has no value: use --{key}=VALUE or --{key} VALUE")
            value = args[i + 1]
            i += 2
        if "." not in key:
            raise ConfigError(f"override --{key}: keys are dotted, like --training.steps")
        pairs.append((key, value))
    return pairs


def env_overrides(environ: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """`MAESTER_TRAINING__STEPS=10` into ("training.steps", "10", variable name); sorted for stability. The
    program's switches (`SWITCHES`) are left out; a `MAESTER_*` variable that is neither is an error."""
    out = []
    for var in sorted(environ):
        if var.startswith(ENV_PREFIX) and var not in SWITCHES:
            if "__" not in var[len(ENV_PREFIX):]:
                raise ConfigError(f"environment variable {var} is neither a config variable (MAESTER_<SECTION>__<KEY>, "
                                  f"e.g. MAESTER_TRAINING__STEPS=10) nor one of maester's switches "
                                  f"({', '.join(SWITCHES)})")
            key = ".".join(part.lower() for part in var[len(ENV_PREFIX):].split("__"))
            out.append((key, environ[var], var))
    return out


DOTENV = ".env"


def read_dotenv(path: Path) -> dict[str, str]:
    """The `KEY=VALUE` lines of a `.env` file (blank lines, `# comments` and a leading `export ` allowed; a value may
    be in single or double quotes); any other line is an error naming it."""
    values: dict[str, str] = {}
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"{path}:{n}: expected KEY=VALUE, got {line[:60]!r}")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].rstrip()
        values[key] = value
    return values


def apply_dotenv(directory: Path, environ: typing.MutableMapping[str, str] = os.environ) -> list[str]:
    """Set the variables of `directory/.env` that the environment does not set already (the environment wins, as
    with python-dotenv); returns the names set. Only the environment changes: the config and its config.json never
    see these values, so secrets such as WANDB_API_KEY stay out of the job directory."""
    path = Path(directory) / DOTENV
    if not path.is_file():
        return []
    added = {k: v for k, v in read_dotenv(path).items() if k not in environ}
    environ.update(added)
    return sorted(added)


def parse_value(raw: str) -> Any:
    """Strings stay strings (pydantic coerces them); JSON lists/objects and null are decoded."""
    stripped = raw.strip()
    if stripped in ("null", "None"):
        return None
    if stripped.startswith(("[", "{")):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            return raw  # e.g. a glob like "[ab]*.parquet"; a list/dict field then rejects the string by name
    return raw


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[_list_index(part, node, parts[:i])]
            continue
        nxt = node.get(part)
        if not isinstance(nxt, (dict, list)):
            nxt = node[part] = {}
        node = nxt
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(last, node, parts[:-1])] = value
    else:
        node[last] = value


def _list_index(part: str, node: list, parents: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"{'.'.join(parents)} has {len(node)} entries; {part!r} is not an index into it")
    return int(part)


def load(schema: type[Schema], path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
         environ: Mapping[str, str] | None = None) -> Schema:
    """`schema` resolved from its defaults, a file, the environment and command-line overrides."""
    environ = os.environ if environ is None else environ
    tree: dict[str, Any] = schema().model_dump(mode="json")
    origins: dict[str, str] = {}
    if path is not None:
        from_file = read_config_file(path)
        problems = check_keys(schema, from_file, "", {"": f"file {path}"})
        if problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
        _deep_merge(tree, from_file)
        origins[""] = f"file {path}"
    for key, raw, var in env_overrides(environ):
        _apply(tree, origins, key, raw, f"environment variable {var}")
    for key, raw in parse_cli_overrides(list(overrides)):
        _apply(tree, origins, key, raw, f"command line --{key}")
    problems = check_keys(schema, tree, "", origins)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    try:
        return schema.model_validate(tree)
    except ValidationError as e:
        raise ConfigError("invalid config:\n  " + "\n  ".join(
            format_pydantic_error(err, "", origins) for err in e.errors())) from None


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    """Merge tables key by key; any other value (lists included) replaces the default."""
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict) and key != "overrides":
            _deep_merge(base[key], value)
        else:
            base[key] = value


def _apply(tree: dict, origins: dict[str, str], key: str, raw: str, origin: str) -> None:
    set_dotted(tree, key, parse_value(raw))
    origins[key] = origin


def check_keys(model: type[BaseModel], tree: Any, prefix: str, origins: Mapping[str, str]) -> list[str]:
    """Unknown keys anywhere in `tree`, each with a did-you-mean and its origin."""
    if not isinstance(tree, dict):
        return []
    problems = []
    fields = model.model_fields
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            problems.append(f"{dotted}: unknown key{suggest(key, fields)}{origin_of(dotted, origins)}")
            continue
        sub = _submodel(fields[key].annotation)
        if sub is None:
            continue
        kind, cls = sub
        if kind == "one":
            problems += check_keys(cls, value, dotted + ".", origins)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                problems += check_keys(cls, item, f"{dotted}.{i}.", origins)
    return problems


def _submodel(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "one", annotation
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            found = _submodel(arg)
            if found:
                return found
    if origin is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return "list", args[0]
    return None
