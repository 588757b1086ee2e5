"""Hugging Face Hub ids where a setting takes a directory (`tokenizer.path`, `model.hf_config`, `checkpoint.init_from
= "hf:..."`, `maester convert from-hf`, `maester generate`): `org/name` or `org/name@revision`, downloaded once into
the standard Hugging Face cache by `huggingface_hub` (which honours `HF_HOME`, `HF_HUB_OFFLINE`, `HF_TOKEN` and the
login of `hf auth login`) and then used as the snapshot directory. A local path that exists always wins.

On a multi-process launch only `LOCAL_RANK` 0 of each node asks the Hub; the other local ranks wait for it on a file
lock in the cache and then read the cache alone (`local_files_only`). A file lock, not a barrier: configs are read
before the process group exists, and the lock also keeps two jobs sharing one cache from reading a half-filled
snapshot. The ground floor of the package: it imports nothing of it, and `huggingface_hub` only when an id is met."""

from __future__ import annotations

import functools
import os
import re
import time
from pathlib import Path

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_])(?:@(?P<revision>[\w.\-/]+))?$")
"""`org/name` with an optional `@revision` (a branch, tag or commit)."""

FILES = {
    "config": ["config.json"],
    "tokenizer": ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "tokenizer.model"],
    "model": ["*.json", "*.safetensors", "tokenizer.model", "chat_template.jinja"],
}
"""What each use fetches of a model repository: top-level files only, never the other formats' weights."""

WAIT_SECONDS = 600.0
"""How long a local rank other than 0 waits for the snapshot to appear while nobody holds the lock."""


# A name ending so is a file, never a Hub id: `data/tokenizer.json` is a missing local file, not a repository.
FILE_SUFFIXES = (".json", ".model", ".tiktoken", ".safetensors", ".bin", ".pt", ".txt", ".jsonl", ".parquet")


def is_hub_id(value: str) -> bool:
    """Whether `value` is spelled as a Hub id and is not a path that exists (a local path always wins)."""
    match = HUB_ID.match(value)
    return (bool(match) and not value.startswith((".", "~")) and not match["repo"].lower().endswith(FILE_SUFFIXES)
            and not Path(value).exists())


def local_path(value: str, key: str, files: str = "model") -> Path:
    """`value` as a local path: itself when it is not a Hub id (see `is_hub_id`), else the snapshot directory of that
    model repository in the Hugging Face cache, fetched with the files `FILES[files]` names. `key` names the setting
    for the errors."""
    if not is_hub_id(value):
        return Path(value)
    return _fetched(value, key, files)


@functools.lru_cache(maxsize=None)
def _fetched(value: str, key: str, files: str) -> Path:
    hub = _import_hub(key, value)
    match = HUB_ID.match(value)
    repo, revision = match["repo"], match["revision"]
    kwargs = dict(repo_id=repo, revision=revision, allow_patterns=FILES[files], ignore_patterns=["*/*"])
    try:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            with _lock(hub, repo):
                return Path(hub.snapshot_download(**kwargs))
        return _wait_for_local_rank_0(hub, kwargs)
    except hub.errors.LocalEntryNotFoundError as e:
        raise ValueError(_not_cached(key, value, repo, revision, e)) from None
    except (hub.errors.RepositoryNotFoundError, hub.errors.RevisionNotFoundError) as e:
        gated = isinstance(e, hub.errors.GatedRepoError)
        what = ("is gated: accept its terms on the model's page and log in (`hf auth login` or HF_TOKEN)" if gated
                else f"has no revision {revision!r}" if isinstance(e, hub.errors.RevisionNotFoundError)
                else "is not a model repository the Hub knows (a private one needs a token: `hf auth login` or "
                     "HF_TOKEN)")
        raise ValueError(f"{key} = {value!r}: no such local path, and as a Hub id, {repo} {what}") from None
    except hub.errors.HfHubHTTPError as e:
        raise ValueError(f"{key} = {value!r}: no such local path, and fetching it from the Hub failed: "
                         f"{str(e).splitlines()[0]}") from None


def _wait_for_local_rank_0(hub, kwargs: dict) -> Path:
    """The snapshot as local rank 0 leaves it: read from the cache under the lock, polled until it is complete."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        with _lock(hub, kwargs["repo_id"]):
            try:
                return Path(hub.snapshot_download(**kwargs, local_files_only=True))
            except hub.errors.LocalEntryNotFoundError:
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.5)


def _lock(hub, repo: str):
    from filelock import FileLock

    locks = Path(hub.constants.HF_HUB_CACHE) / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / f"maester--{repo.replace('/', '--')}.lock"))


def _not_cached(key: str, value: str, repo: str, revision: str | None, error: Exception) -> str:
    why = ("HF_HUB_OFFLINE is set" if hub_offline() else
           "the Hub cannot be reached" if int(os.environ.get("LOCAL_RANK", "0")) == 0 else
           f"local rank 0 did not fetch it within {WAIT_SECONDS:.0f} s")
    fetch = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    return (f"{key} = {value!r}: no such local path, and the Hub model {repo} is not in the Hugging Face cache "
            f"({_cache_dir()}) and {why}. Fetch it on a machine with internet (`{fetch}`), copy that HF_HOME here "
            f"and point HF_HOME at it, or give a local directory ({str(error).splitlines()[0]})")


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE asks that the Hub not be reached."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _import_hub(key: str, value: str):
    return import_hub(f"{key} = {value!r} is not a local path, and reading it as a Hub id")


def import_hub(needed_for: str):
    """`huggingface_hub` with the submodules used here, or a ValueError saying that `needed_for` (a phrase: what
    needs it) needs maester's `hub` extra."""
    try:
        import huggingface_hub
        import huggingface_hub.constants  # noqa: F401  (the submodules, for the names used above)
        import huggingface_hub.errors  # noqa: F401
    except ImportError:
        raise ValueError(f"{needed_for} needs huggingface_hub: install maester's `hub` extra "
                         "(pip install 'maester[hub]')") from None
    return huggingface_hub
