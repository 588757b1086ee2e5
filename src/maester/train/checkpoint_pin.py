"""A reader's pin on the checkpoint it reads: `maester eval`, `generate` and `chat` may read a job while it trains,
and the job's retention must not remove the checkpoint under them. A reader holds a shared `flock` on the
checkpoint's directory while it reads (`Pins`; the readers choose and pin in
`maester.tools.generate.pinned_checkpoint`); retention takes the lock exclusively, without waiting, before it
removes a checkpoint, and keeps one that a reader holds until a later save (`unless_pinned`).

The lock is on the directory itself, so nothing is written into the checkpoint (a read-only mount can be read).
Local filesystems and Lustre mounted with `-o flock` share these locks; where a filesystem has none (NFS, whose
emulated locks take no exclusive lock on a directory), nothing is pinned and retention removes as it always did."""

from __future__ import annotations

import errno
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path



def _open_directory(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _no_locks(error: OSError) -> bool:
    """A filesystem that takes no such lock (rather than a lock held by someone else)."""
    return error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.ENOSYS)


class Pins:
    """Shared locks on checkpoint directories, by resolved path."""

    def __init__(self):
        self.held: dict[Path, int] = {}

    def add(self, path: Path) -> bool:
        """Pin `path`; False where it is gone or being removed (retention holds it, or renamed it since it was
        opened). Where locks are not supported it is taken unpinned (True)."""
        fd = _open_directory(path)
        if fd is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        except OSError as e:
            os.close(fd)
            if isinstance(e, BlockingIOError):
                return False
            if not _no_locks(e):
                raise
            return True
        if not same:
            os.close(fd)
            return False
        self.held[path.resolve()] = fd
        return True

    def keep_only(self, path: Path) -> None:
        for other in [p for p in self.held if p != path]:
            os.close(self.held.pop(other))

    def release(self) -> None:
        while self.held:
            os.close(self.held.popitem()[1])


@contextmanager
def unless_pinned(path: Path):
    """Whether retention may remove the checkpoint `path` now (False: a reader pins it); while inside, a True
    holds it exclusively, so that no reader pins it before it is gone."""
    fd = _open_directory(path)
    free = True
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            free = False
        except OSError as e:
            if not _no_locks(e):
                os.close(fd)
                raise
    try:
        yield free
    finally:
        if fd is not None:
            os.close(fd)
