"""`maester data download hf://datasets/org/name[@revision][/<glob or directory>] --output DIR`: the files a Hub
source reads, fetched for a cluster whose compute nodes have no internet, at the commit its revision names now.

Each file lands at `DIR/<its path in the repository>`, so that `DIR/<the glob or directory>` is the local source
that reads the same documents in the same order (and the same validation split) as the `hf://` one. Files are
fetched into `DIR/.partial-download/` (hidden: a source pointed at DIR never reads it), each under a temporary name
renamed once whole, and moved into DIR only when all are there; the manifest `DIR/.download.json` (repository,
commit, source, each file's size and sha256) is written last, so DIR with a manifest is a complete download. A run
that was stopped continues with the files it finished. DIR must be empty, new, or hold this same download (same
source at the same commit: nothing is fetched again, and every file is checked against its sha256 in the manifest
unless `verify` is off); anything else is refused rather than mixed.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from maester.data.downloads import MANIFEST, check_download, sha256_of
from maester.data.hub_datasets import HubDatasetPath, HubFile, fs_path, network_errors, resolve_hub_files
from maester.files import AtomicOutputs, fsync_dir, read_json_object, write_atomically
from maester.hub import hub_offline, import_hub

PARTIAL = ".partial-download"


@dataclass
class DownloadSummary:
    source: str
    output: Path
    commit: str
    files: list[dict] = field(default_factory=list)
    fetched: int = 0  # files fetched by this run; the others were there already

    def line(self) -> str:
        where = HubDatasetPath.parse(self.source)
        listing = "".join(f"  {f['path']}  {f['size']} bytes\n" for f in self.files)
        return (f"{listing}download: files={len(self.files)} fetched={self.fetched} "
                f"bytes={sum(f['size'] for f in self.files)} repo={where.repo} commit={self.commit} "
                f"output={self.output} manifest={self.output / MANIFEST} "
                f"source={where.local_source(str(self.output))!r}")


def download(source: str, output: str | os.PathLike, verify: bool = True) -> DownloadSummary:
    """Fetch the files of the Hub source `source` into `output`; see the module's docstring."""
    where = HubDatasetPath.parse(source)
    hub = import_hub("maester data download")
    if hub_offline():
        raise ValueError("maester data download fetches from the Hugging Face Hub, and HF_HUB_OFFLINE is set: run "
                         "it on a machine with internet, without HF_HUB_OFFLINE")
    files = resolve_hub_files(source, parquet_only=False)
    out = Path(output)
    summary = DownloadSummary(source, out, files[0].commit)
    if _same_download_there(out, where, files, verify):
        summary.files = read_json_object(out / MANIFEST)["files"]
        return summary
    partial = out / PARTIAL
    fs = hub.HfFileSystem()
    from maester.progress import progress_bar

    with progress_bar("download", total=sum(f.size for f in files), unit="B", unit_scale=True) as bar:
        for f in files:
            summary.fetched += _fetch(fs, hub, f, partial / f.path)
            bar.update(f.size)
    for f in files:
        summary.files.append({"path": f.path, "size": f.size, "sha256": sha256_of(partial / f.path)})
    for f in files:
        (out / f.path).parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial / f.path, out / f.path)
        fsync_dir((out / f.path).parent)
    manifest = {"repo": where.repo, "revision": where.revision or "main", "commit": summary.commit,
                "source": source, "files": summary.files}
    write_atomically(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(partial)
    return summary


def _same_download_there(out: Path, where: HubDatasetPath, files: list[HubFile], verify: bool) -> bool:
    """True when `out` holds this download already, its files as the manifest lists them (sizes; with `verify`,
    sha256s); an error when it holds anything else but an unfinished run's files; False when there is something to
    fetch."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise ValueError(f"--output {out}: not a directory")
    if (out / MANIFEST).exists():
        had = read_json_object(out / MANIFEST)
        same = (had.get("repo"), had.get("commit"), sorted(f["path"] for f in had.get("files", []))) == (
            where.repo, files[0].commit, sorted(f.path for f in files))
        if not same:
            raise ValueError(f"--output {out} holds another download ({had.get('source')} at commit "
                             f"{had.get('commit')}), not {where.source} at commit {files[0].commit}: give an empty "
                             f"or new directory")
        check_download(out, had["files"], hashes=verify)
        return True
    others = sorted(p.name for p in out.iterdir() if p.name != PARTIAL)
    if others:
        raise ValueError(f"--output {out} is not empty ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
                         f" and holds no download ({MANIFEST}): give an empty or new directory")
    return False


def _fetch(fs, hub, f: HubFile, dest: Path) -> int:
    """Fetch one file to `dest`, under a temporary name until whole; 0 if an earlier run left it there whole."""
    if dest.is_file() and dest.stat().st_size == f.size:
        return 0
    with AtomicOutputs() as outputs:
        tmp = outputs.temp_for(dest)
        try:
            fs.get_file(fs_path(f.repo, f.commit, f.path), str(tmp))
        except network_errors(hub) as e:
            raise ValueError(f"{f}: fetching it failed: {str(e).splitlines()[0]}") from None
        if tmp.stat().st_size != f.size:
            raise ValueError(f"{f}: fetched {tmp.stat().st_size} bytes, the Hub lists {f.size}")
    return 1
