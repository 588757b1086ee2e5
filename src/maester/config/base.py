"""What every section of the config tree shares: the base class, the error type, and messages that name the
dotted key, suggest the closest name and say where a value came from. Below the models, which validate their own
architecture sections with it."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config that cannot be used; the message names every bad key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def suggest(name: str, choices: Any) -> str:
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=3, cutoff=0.5)
    if close:
        return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"
    return " (choices: " + ", ".join(repr(str(c)) for c in choices) + ")"


def origin_of(dotted: str, origins: Mapping[str, str] | None) -> str:
    if not origins:
        return ""
    parts = dotted.split(".") if dotted else []
    for n in range(len(parts), 0, -1):
        origin = origins.get(".".join(parts[:n]))
        if origin:
            return f" [from {origin}]"
    below = sorted({o for k, o in origins.items() if k.startswith(dotted + ".")}) if dotted else []
    if below:
        return " [from " + "; ".join(below) + "]"
    return f" [from {origins['']}]" if "" in origins else ""


def format_pydantic_error(err: Mapping[str, Any], prefix: str, origins: Mapping[str, str] | None) -> str:
    loc = ".".join(str(p) for p in err.get("loc", ()))
    dotted = ".".join(p for p in (prefix, loc) if p)
    msg = err.get("msg", "invalid")
    if err.get("type") == "value_error":
        msg = msg.removeprefix("Value error, ")
        names_key = "." in msg.split(" ", 1)[0]  # the validator's message already names the dotted key
        head = "" if names_key or not dotted else f"{dotted}: "
        if not dotted and origins:  # a check across sections: the origins of the keys it names
            named = sorted({f"{key} from {origins[key]}" for key in re.findall(r"[a-z_]+\.[a-z_.]+", msg)
                            if key in origins})
            where = "; ".join(named) or origins.get("", "")
            return f"{msg} [{where}]" if where else msg
        return f"{head}{msg}{origin_of(dotted, origins)}"
    got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], (dict, list)) else ""
    return f"{dotted or '<root>'}: {msg}{got}{origin_of(dotted, origins)}"
