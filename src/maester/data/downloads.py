"""The files of a `maester data download` directory checked against its manifest (`DIR/.download.json`: each file's
path, size and sha256): when the download is run again, and when a run trains on files of such a directory, so that
a file changed since it was fetched (swapped, rewritten in place, damaged) is an error naming it, not data trained on
in silence.

A run remembers what it checked in its job directory (`verified-downloads.json`: each file's size, modification time
and sha256), so a resume hashes only the files that changed since; `data.verify_downloads = false` skips the check.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from maester.files import read_json_object, write_atomically

log = logging.getLogger("maester")

MANIFEST = ".download.json"
VERIFIED = "verified-downloads.json"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def check_download(directory: Path, entries: list[dict], hashes: bool = True) -> None:
    """Each manifest entry ({path, size, sha256}) of download `directory` against its file: present, of its size,
    and (with `hashes`) of its sha256; the first one that differs is a ValueError naming it."""
    for entry in entries:
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), str)):
            raise ValueError(f"{directory / MANIFEST}: not a download manifest (an entry {entry!r} lacks its path, "
                             f"size or sha256)")
        check_file(directory, directory / entry["path"], entry, hashes)


def check_file(directory: Path, file: Path, entry: dict, hashes: bool) -> None:
    """`file` of download `directory` against its manifest entry: present, of its size, and (with `hashes`) of its
    sha256; a ValueError naming it where it differs."""
    if not file.is_file() or file.stat().st_size != entry["size"]:
        raise ValueError(f"{file} is missing or of another size than {directory / MANIFEST} says: the download "
                         f"was changed since it was fetched; remove {directory} and download again")
    if hashes and sha256_of(file) != entry["sha256"]:
        raise ValueError(f"{file} is not the file that was downloaded: its sha256 differs from {directory / MANIFEST}'s "
                         f"(it was replaced or changed since). Remove {directory} and download again "
                         f"(data.verify_downloads = false trains on it as it is)")


def download_manifest_of(file: Path, cache: dict[Path, tuple[Path, dict] | None]) -> tuple[Path, dict] | None:
    """(download directory, manifest entry) of `file` where a directory above it holds a download manifest that
    lists it, else None. `cache` maps the directories looked at to what they hold."""
    file = file.resolve()
    for directory in file.parents:
        if directory not in cache:
            manifest = directory / MANIFEST
            if manifest.is_file():
                listed = {e["path"]: e for e in read_json_object(manifest).get("files", [])
                          if isinstance(e, dict) and {"path", "size", "sha256"} <= set(e)}
                cache[directory] = (directory, listed)
            else:
                cache[directory] = None
        found = cache[directory]
        if found is not None:
            entry = found[1].get(file.relative_to(directory).as_posix())
            return (directory, entry) if entry is not None else None
    return None


def verify_downloaded(data, record: Path) -> int:
    """Check every local file of the sources of `data` (a `DataConfig`: training and validation) that lies in a
    download directory against its manifest entry (size, then sha256, unless `record` remembers this file at this
    size and modification time with that sha256); update `record`. Returns how many files were hashed."""
    from maester.data.sources import local_files

    files = [f for source in data.sources + data.validation for f in local_files(source)]
    try:
        known = json.loads(record.read_text()) if record.is_file() else {}
    except ValueError:
        known = {}
    manifests: dict = {}
    hashed = 0
    for file in files:
        found = download_manifest_of(file, manifests)
        if found is None:
            continue
        directory, entry = found
        st, key = file.stat(), str(file.resolve())
        seen = [st.st_size, st.st_mtime_ns, entry["sha256"]]
        check_file(directory, file, entry, hashes=known.get(key) != seen)
        if known.get(key) != seen:
            known[key] = seen
            hashed += 1
    if hashed:
        write_atomically(record, json.dumps(known, indent=1) + "\n")
        log.info("checked %d downloaded file(s) against their download manifests (sha256)", hashed)
    return hashed
