"""Every frame of a zstd file as one stream of bytes (the reader behind `records`' `.jsonl.zst`)."""

from __future__ import annotations

import io
from pathlib import Path

READ_BYTES = 1 << 20


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every frame of a zstd file. A file that ends inside a frame is an error
    (zstandard's own stream reader returns the partial frame without one)."""

    def __init__(self, path: Path):
        import zstandard

        self._dctx = zstandard.ZstdDecompressor()
        self._file = open(path, "rb")
        self._frame = None  # the decompressor of the frame being read; None between frames
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not len(self._pending):
            if self._frame is not None and self._frame.eof:
                data = self._frame.unused_data or self._file.read(READ_BYTES)
                self._frame = None
            else:
                data = self._file.read(READ_BYTES)
            if not data:
                if self._frame is not None:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            self._pending = memoryview(self._frame.decompress(data))
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._file.close()
        super().close()
