"""The checksums of a checkpoint's manifest: XXH3-128 of every file, computed while DCP writes it (a stream over the
bytes it writes, not a second read of the finished files), and read back without copying (a file is mapped, not
read into a buffer). XXH3 runs at memory speed (8 GB/s on one core of the machine the figures in docs/checkpoints.md
come from, CRC-32 1.8 GB/s) and releases the GIL, so it overlaps with writes and copies in other threads.

Manifest format 2 holds `xxh3_128` per file; a manifest without a format (written before it) holds `crc32`, and is
still verified with it."""

from __future__ import annotations

import io
import mmap
import os
import stat
import threading
import zlib
from contextlib import contextmanager
from pathlib import Path

import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

MANIFEST_FORMAT = 2
DIGEST = "xxh3_128"
CHUNK = 16 << 20  # bytes hashed per call: big enough to amortise the call, small enough to stay near the copy


def new_digest():
    return xxhash.xxh3_128()


def digest_of_bytes(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


@contextmanager
def mapped(path: Path, private: bool = False):
    """A regular file mapped read-only, or `private`ly (copy on write: writable for torch.frombuffer, while nothing
    is written the pages are the page cache's). Opened without blocking, so that a FIFO put in its place cannot hang
    the read; anything but a regular file is a ValueError; an empty file is b""."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if st.st_size == 0:
            yield b""
            return
        m = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY if private else mmap.ACCESS_READ)
        m.madvise(mmap.MADV_SEQUENTIAL)
        try:
            yield m
        finally:
            try:
                m.close()
            except BufferError:  # a tensor still viewing it (an error's traceback holds it): closed when collected
                pass
    finally:
        os.close(fd)


def hash_buffer(buffer, digest=None) -> str:
    """The XXH3-128 of a buffer (a mapped file), fed in chunks."""
    digest = digest or new_digest()
    view = memoryview(buffer)
    try:
        for start in range(0, len(view), CHUNK):
            digest.update(view[start:start + CHUNK])
    finally:
        view.release()
    return digest.hexdigest()


def checksum_of_buffer(buffer, kind: str) -> str:
    """The checksum `kind` (`xxh3_128`, or `crc32` of a manifest from before format 2) of a buffer."""
    if kind == DIGEST:
        return hash_buffer(buffer)
    crc, view = 0, memoryview(buffer)
    try:
        for start in range(0, len(view), CHUNK):
            crc = zlib.crc32(view[start:start + CHUNK], crc)
    finally:
        view.release()
    return f"{crc:08x}"


def file_digest(path: Path, kind: str) -> str:
    """The checksum `kind` of a regular file, read through a mapping of it."""
    with mapped(path) as buffer:
        return checksum_of_buffer(buffer, kind)


class _HashingStream(io.RawIOBase):
    """A file being written, hashed as its bytes go through (`write` is the only way in: torch.save and DCP write
    sequentially). On close its size and digest go into `record`."""

    def __init__(self, raw, name: str, record: dict[str, dict]):
        super().__init__()
        self.raw, self.name_in_checkpoint, self.record = raw, name, record
        self.digest, self.size = new_digest(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self.digest.update(view)
        written = 0
        while written < len(view):  # a raw file may write less than asked
            written += self.raw.write(view[written:])
        self.size += written
        return written

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
            self.record[self.name_in_checkpoint] = {"size": self.size, DIGEST: self.digest.hexdigest()}
        super().close()


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording the size and digest of every file written through it, by its name in the
    checkpoint directory (DCP writes `.metadata` under a temporary name and renames it)."""

    def __init__(self, root: Path):
        super().__init__()
        self.root, self.files, self._lock = Path(root), {}, threading.Lock()

    def _name(self, path) -> str:
        return Path(path).relative_to(self.root).as_posix()

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        record: dict[str, dict] = {}
        with open(path, mode, buffering=0) as raw:  # unbuffered: the writes are large, the hash sees each once
            stream = _HashingStream(raw, self._name(path), record)
            try:
                yield stream
            finally:
                stream.close()
        with self._lock:
            self.files.update(record)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            self.files[self._name(new_path)] = self.files.pop(self._name(path))


class HashingWriter(FileSystemWriter):
    """DCP's file writer (fsync of every file, as it does by default), whose files' sizes and XXH3-128 are in
    `files` once `dcp.save` returns; `thread_count` files per rank are written at once."""

    def __init__(self, path: Path, thread_count: int = 1):
        super().__init__(path, thread_count=thread_count)
        self.fs = _HashingFileSystem(Path(path))

    @property
    def files(self) -> dict[str, dict]:
        return dict(self.fs.files)
