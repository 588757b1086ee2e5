"""Parquet shards of a Hugging Face dataset repository as a data source: `hf://datasets/org/name[@revision]/<glob or
directory>`, read straight from the Hub through `huggingface_hub`'s `HfFileSystem` (which honours HF_ENDPOINT,
HF_TOKEN and the login of `hf auth login`), footer and row groups by HTTP range, never a whole download.

The revision (default `main`) is pinned to its commit when the source is resolved: every file is read at that
commit, so that the files a run starts with are the files it keeps reading, and the loaders record the commit, so
that a resume on a dataset that has moved since is an error naming both commits (`revision_changed`). A directory
means its data files (as a local directory: hidden files and other suffixes left out); a glob, its matches; both
sorted. Only Parquet is read from the Hub; `maester data download` (`tools/data_download.py`) fetches the same
files for a cluster without internet, which then reads them as a local directory.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote

from maester.data.records import file_format, input_format
from maester.hub import hub_offline, import_hub

HF_DATASET = re.compile(r"^hf://datasets/(?P<repo>[\w.-]+/[\w.-]+?)(?:@(?P<revision>[^/]+))?(?:/(?P<pattern>.*))?$")
"""`hf://datasets/org/name`, an optional `@revision` (a branch, tag or commit; `/` in it written `%2F`), a path."""

SPELLING = "hf://datasets/org/name[@revision]/<glob or directory>"


def is_hub_source(path: str) -> bool:
    """Whether a data source's path names files on the Hub."""
    return path.startswith("hf://")


@dataclass(frozen=True)
class HubDatasetPath:
    """A parsed `hf://datasets/...` source: repository, revision as given (None: `main`), path or glob inside."""

    source: str
    repo: str
    revision: str | None
    pattern: str

    @classmethod
    def parse(cls, source: str) -> "HubDatasetPath":
        match = HF_DATASET.match(source)
        if match is None:
            raise ValueError(f"data source {source!r}: a Hub source is spelled {SPELLING} (only dataset "
                             f"repositories are read as data)")
        revision = unquote(match["revision"]) if match["revision"] else None
        return cls(source, match["repo"], revision, (match["pattern"] or "").strip("/"))

    def pinned(self, commit: str) -> str:
        """The same source with its revision replaced by a commit."""
        return f"hf://datasets/{self.repo}@{commit}" + (f"/{self.pattern}" if self.pattern else "")

    def download_command(self) -> str:
        return f"maester data download {self.source} --output DIR"

    def local_source(self, directory: str) -> str:
        """What to read in place of this source once `maester data download` has written it to `directory`."""
        return f"{directory.rstrip('/')}/{self.pattern}" if self.pattern else directory


@dataclass(frozen=True)
class HubFile:
    """One file of a dataset repository at a commit. Not a `Path`: `records` reads it through `open()`, and `str()`
    names it in errors as the source spelled it (`hf://datasets/org/name/data/train-0.parquet`)."""

    repo: str
    commit: str
    path: str  # inside the repository
    size: int
    revision: str | None  # as the source gave it, for the name in errors
    key_name: str  # its name relative to the source (a directory's files) or its file name (a glob's), as locally

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    def __str__(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        return f"hf://datasets/{self.repo}{at}/{self.path}"

    def open(self):
        """A seekable binary file that fetches the byte ranges read, at the pinned commit."""
        hub = import_hub(f"reading {self}")
        # the size is known from the listing: no request to ask for it again
        return hub.HfFileSystem().open(fs_path(self.repo, self.commit, self.path), "rb", size=self.size)


def fs_path(repo: str, commit: str, path: str = "") -> str:
    """A repository path at a commit as `HfFileSystem` names it."""
    return f"datasets/{repo}@{commit}" + (f"/{path}" if path else "")


def resolve_hub_files(source: str, fmt: str = "auto", parquet_only: bool = True) -> list[HubFile]:
    """The files of a Hub source at the commit its revision names now, sorted; with `parquet_only`, an error for a
    file that is not Parquet (read those after `maester data download`)."""
    where = HubDatasetPath.parse(source)
    hub = import_hub(f"data source {source!r} is on the Hugging Face Hub; reading it")
    if hub_offline():
        raise ValueError(offline_error(where))
    try:
        commit = hub.HfApi().dataset_info(where.repo, revision=where.revision).sha
        listed = _listing(hub.HfFileSystem(), where, commit)
    except FileNotFoundError:  # the Hub answered: nothing there (an OSError, but not a network error)
        raise ValueError(f"data source {source!r}: {where.pattern} does not exist in {where.repo}") from None
    except (hub.errors.RepositoryNotFoundError, hub.errors.RevisionNotFoundError) as e:
        what = (f"has no revision {where.revision!r}" if isinstance(e, hub.errors.RevisionNotFoundError)
                else "is not a dataset repository the Hub knows (a private or gated one needs a token: "
                     "`hf auth login` or HF_TOKEN)")
        raise ValueError(f"data source {source!r}: {where.repo} {what}") from None
    except network_errors(hub) as e:
        raise ValueError(f"data source {source!r}: the Hub cannot be reached ({str(e).splitlines()[0]}). "
                         f"{_fetch_hint(where)}") from None
    files = [HubFile(where.repo, commit, path, size, where.revision, key) for path, size, key in listed]
    for f in files:
        found = file_format(f, fmt)
        if parquet_only and found != "parquet":
            raise ValueError(f"data source {source!r}: {f} is {found}; only Parquet is read from the Hub. "
                             f"{_fetch_hint(where)}")
    return files


def _listing(fs, where: HubDatasetPath, commit: str) -> list[tuple[str, int, str]]:
    """(path in the repository, size, key name) of the source's files at `commit`, sorted by path."""
    root = fs_path(where.repo, commit)
    target = f"{root}/{where.pattern}" if where.pattern else root
    magic = any(ch in where.pattern for ch in "*?[")
    found = fs.glob(target, detail=True) if magic else fs.find(target, detail=True)
    files = sorted((name[len(root) + 1:], info["size"]) for name, info in found.items() if info["type"] == "file")
    if not magic:  # a directory's data files, as a local directory's; a file itself
        single = len(files) == 1 and files[0][0] == where.pattern
        files = [(p, s) for p, s in files if single or (not PurePosixPath(p).name.startswith(".")
                                                        and _is_data_file(p))]
    if not files:
        raise ValueError(f"data source {where.source!r}: "
                         + (f"the pattern matches no files at commit {commit}" if magic else
                            f"no data files ({'.parquet, ...' if where.pattern else 'in the repository'}) "
                            f"at {where.pattern or 'the top'} at commit {commit}"))
    if magic or (len(files) == 1 and files[0][0] == where.pattern):
        return [(p, s, PurePosixPath(p).name) for p, s in files]
    prefix = f"{where.pattern}/" if where.pattern else ""
    return [(p, s, p[len(prefix):]) for p, s in files]


def _is_data_file(path: str) -> bool:
    try:
        input_format(PurePosixPath(path))
    except ValueError:
        return False
    return True


def network_errors(hub) -> tuple[type[BaseException], ...]:
    """What a call to the Hub raises when it gets no good answer: an HTTP error, offline mode, or a transport error
    of the HTTP client `huggingface_hub` uses (httpx, or its successor)."""
    transport = tuple(sys.modules[m].TransportError for m in ("httpx", "httpx2") if m in sys.modules)
    return (OSError, hub.errors.HfHubHTTPError) + transport


def source_identity(path: str) -> str:
    """A source's path as fingerprints and checkpoints name it: a Hub source without its revision (the commit read
    is recorded beside it), so that pinning the commit a run read resumes it; any other path as it is."""
    if not is_hub_source(path):
        return path
    where = HubDatasetPath.parse(path)
    return f"hf://datasets/{where.repo}" + (f"/{where.pattern}" if where.pattern else "")


def pinned_commits(files) -> list[str]:
    """The commits of the Hub files among `files` (none for local files), for a loader's fingerprint."""
    return sorted({f.commit for f in files if isinstance(f, HubFile)})


def source_commits(sources, files_of) -> dict[str, str]:
    """Data source (`source_identity`) -> the commit its Hub files were read at, for the sources on the Hub."""
    return {source_identity(cfg.path): commits[0] for cfg, files in zip(sources, files_of)
            if len(commits := pinned_commits(files)) == 1}


def revision_changed(source: str, then: str, now: str) -> str:
    """The error of a resume on a Hub source whose revision has moved since the checkpoint."""
    where = HubDatasetPath.parse(source)
    return (f"data source {source!r} was read at commit {then} of {where.repo} when the checkpoint was written, and "
            f"it resolves to commit {now} now: the data position would count in other files. To resume on the data "
            f"trained on, pin the commit: path = {where.pinned(then)!r}; refusing to resume on it")


def offline_error(where: HubDatasetPath) -> str:
    return (f"data source {where.source!r} is read from the Hugging Face Hub, and HF_HUB_OFFLINE is set. "
            f"{_fetch_hint(where)}")


def _fetch_hint(where: HubDatasetPath) -> str:
    return (f"On a machine with internet, fetch the dataset {where.repo}'s files with `{where.download_command()}`, "
            f"then copy DIR here and point the source at {where.local_source('DIR')!r}")
