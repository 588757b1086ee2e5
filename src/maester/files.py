"""Files written under a temporary name beside their final one and renamed into place when complete
(`AtomicOutputs`), so a run that fails leaves nothing under a final name: created with the mode the umask gives
(not mkstemp's 0600, which hides outputs from the other users of a shared project directory), and named by host
and process so that a later run removes what a killed one left. The ground floor of the package: it imports
nothing of it."""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import secrets
import socket
from pathlib import Path

log = logging.getLogger("maester")


def umask_mode(mode: int = 0o666) -> int:
    """`mode` less the process's umask (read by setting it, the only way, and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mode & ~mask


def temp_beside(final: Path) -> Path:
    """A new empty file `.<name>.<host>-<pid>.<random>.tmp` in `final`'s directory, after removing the temporaries
    of `final` that dead processes of this host left."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final)
    host = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())
    while True:
        path = final.parent / f".{final.name}.{host}-{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask applies
        except FileExistsError:
            continue
        os.close(fd)
        if not _created:
            atexit.register(_remove_created)
        _created.append(path)
        return path


_created: list[Path] = []


def _remove_created() -> None:
    """At exit, whatever way: a temporary still under its temporary name was not committed (a commit renames it
    away), e.g. when Ctrl-C came between its creation and the `with` block that would remove it."""
    for path in _created:
        path.unlink(missing_ok=True)


def remove_stale_temporaries(final: Path) -> list[Path]:
    """Remove `final`'s temporaries whose process (on this host) is gone; returns them."""
    host = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())
    pattern = re.compile(rf"^\.{re.escape(Path(final).name)}\.{re.escape(host)}-(\d+)\.[0-9a-f]+\.tmp$")
    removed = []
    if not Path(final).parent.is_dir():
        return removed
    for path in Path(final).parent.iterdir():
        match = pattern.match(path.name)
        if match and not _alive(int(match[1])):
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.info("removed %d temporary file(s) left by a killed run: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class AtomicOutputs:
    """Use as a context manager: a clean exit renames every temporary file onto its final name, an exception
    removes them all.

    `key`: a final name readers look for first (an index beside its data). It is removed before the others are
    renamed and renamed last, so that a reader never sees a new file beside the old key, or the other way round.
    """

    def __init__(self, key: Path | None = None) -> None:
        self._pairs: list[tuple[Path, Path]] = []
        self._key = None if key is None else Path(key)

    def __enter__(self) -> "AtomicOutputs":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()

    def temp_for(self, final: Path) -> Path:
        """A new empty temporary file in `final`'s directory, to be renamed to `final` on commit."""
        name = temp_beside(Path(final))
        self._pairs.append((name, Path(final)))
        return name

    def commit(self) -> None:
        try:
            for tmp, _ in self._pairs:
                fsync_file(tmp)
            pairs = sorted(self._pairs, key=lambda pair: pair[1] == self._key)  # the key last
            if self._key is not None and len(pairs) > 1:
                self._key.unlink(missing_ok=True)
            for tmp, final in pairs:
                os.replace(tmp, final)
        except BaseException:
            self.discard()
            raise
        self._pairs.clear()

    def discard(self) -> None:
        for tmp, _ in self._pairs:
            tmp.unlink(missing_ok=True)
        self._pairs.clear()


def create_new(path: Path, text: str = "") -> bool:
    """Create `path` holding `text` unless it exists (O_EXCL: of several processes trying, exactly one creates it);
    True for the one that did. A marker or a first-come record, not a durable write."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def fsync_file(path: Path) -> None:
    """Flush a written file's data to disk."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename, a new file) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: str | bytes) -> None:
    """Write `path` and flush it to disk, in place: for files inside a directory that is itself renamed into place
    when complete (a checkpoint)."""
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def point_link(link: Path, target: str) -> None:
    """Make the symlink `link` point to `target` (relative to its directory) in one rename, and flush that to disk:
    a reader sees the old target or the new one, never no link."""
    link = Path(link)
    tmp = link.with_name(f".{link.name}.link.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)
    fsync_dir(link.parent)


def write_atomically(path: Path, data: str | bytes) -> None:
    """`path` holds `data` whole, or keeps what it held: written beside it under a temporary name, flushed to disk,
    then renamed over it."""
    with AtomicOutputs() as out:
        with open(out.temp_for(Path(path)), "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object; errors name the file."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON {type(data).__name__}, not an object")
    return data


# Two conventions for sizes, each where its users expect it.
def parse_shard_size(text: str) -> int:
    """Hugging Face's `max_shard_size`: '5GB' and '500MB' are decimal, '2GiB' binary; or a plain number of
    bytes. At least one byte; the error says what was expected, not which option gave it."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    match = re.fullmatch(r"(\d+(?:\.\d*)?(?:[eE]\d+)?|\.\d+)\s*([A-Za-z]*)", text.strip())
    if not match or match[2].upper() not in units:
        raise ValueError("expected a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB), e.g. 5GB or "
                         "500MB")
    size = math.floor(float(match[1]) * units[match[2].upper()])
    if size < 1:
        raise ValueError("a shard holds at least one byte: give a size such as 5GB or 500MB")
    return size


def parse_buffer_size(text: str) -> int:
    """nccl-tests' `-b`/`-e`: `4096`, `64K`, `32MiB`, `1G`, all binary multiples."""
    multiples = {"": 1, "K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GIB": 1 << 30}
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", text.strip())
    if not match or match.group(2).upper() not in multiples or int(match.group(1)) == 0:
        raise ValueError(f"--sizes: {text!r} is not a size in bytes (e.g. 4096, 64K, 32MiB, 1G)")
    return int(match.group(1)) * multiples[match.group(2).upper()]


def check_writable(path: Path, flag: str) -> None:
    """Refuse now what writing the file `path` (named by the option `flag`) would fail at later: a directory, or a
    place that takes no new file (read-only, immutable, no permission). A directory still missing is fine where the
    nearest one that exists takes a new file (the write creates the rest). Nothing is left behind."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory: give the name of the file to write")
    existing = next(p for p in [path.parent, *path.parent.parents] if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is not a directory")
    probe = existing / f".write-test-{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be written ({e.strerror or e}): give a file in a writable "
                         f"directory") from None
    probe.unlink()
