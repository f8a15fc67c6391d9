"""Byte ranges of a file copied straight to new device arrays through pinned staging buffers.

A model load that maps the whole GGUF and uploads tensors from the mapping ends up holding the
file's pages in its RSS; this reads each range in chunks into one of two page-locked buffers
instead, so the process holds about 2 × chunk_bytes of host memory whatever the file's size.
While the GPU copies one buffer (an asynchronous DMA on the given stream), the host reads the
next chunk from the file into the other (read_threads preadv calls at once); a StreamMark per
buffer says when its copy is done and it may be refilled.

    with FileUploader(path, stream) as up:
        data = up.upload(info.offset, info.n_bytes)   # == to_device_bytes(raw, stream)

Like to_device_bytes on a stream, the returned array is filled once the stream reaches the copies.
Under NUMBA_ENABLE_CUDASIM=1 pinned arrays are plain numpy arrays and every copy is immediate.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from numba import cuda

from sparkinfer_cli.kernels.cuda.runtime.driver_calls import StreamMark, copy_to_device_async
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import IS_SIMULATOR
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv

# to_device_bytes pads an n-byte upload to cdiv(n + 16, 16) * 16: 16 to 31 zero bytes
MAX_PAD = 31

# a chunk is read as slices of this size, by read_threads threads at once: one thread copies
# ~5 GB/s out of the page cache, 8 of them 16-20 GB/s (H100 host, 16 cores), the DMA ~32 GB/s
READ_SLICE = 4 << 20
READ_THREADS = min(8, os.cpu_count() or 1)

Piece = tuple[int, int]  # (file offset, n_bytes)


def padded_size(n_bytes: int) -> int:
    """The size of to_device_bytes' array for n_bytes of data."""
    return cdiv(n_bytes + 16, 16) * 16


def chunk_pieces(ranges: Sequence[Piece], chunk_bytes: int) -> list[list[Piece]]:
    """The ranges' bytes, in order, cut into chunks of chunk_bytes (the last may be shorter, and
    there is always at least one, empty when the ranges are); a chunk may span several ranges."""
    chunks: list[list[Piece]] = [[]]
    room = chunk_bytes
    for offset, n_bytes in ranges:
        while n_bytes > 0:
            if room == 0:
                chunks.append([])
                room = chunk_bytes
            take = min(n_bytes, room)
            chunks[-1].append((offset, take))
            offset, n_bytes, room = offset + take, n_bytes - take, room - take
    return chunks


class FileUploader:
    """Uploads byte ranges of one file to new device arrays through two pinned staging buffers.

    stream: the numba stream the copies are queued on (None or 0: the default stream).
    chunk_bytes: the size of each staging buffer (page-locked host memory, 2 of them).
    read_threads: threads that read a chunk's slices from the file at once."""

    def __init__(self, path: str | Path, stream=None, chunk_bytes: int = 64 << 20,
                 read_threads: int = READ_THREADS):
        if chunk_bytes <= 0 or read_threads <= 0:
            raise ValueError(f"chunk_bytes and read_threads must be positive, got {chunk_bytes} "
                             f"and {read_threads}")
        self.path = Path(path)
        is_default = stream is None or isinstance(stream, int) and stream == 0
        self.stream = cuda.default_stream() if is_default else stream
        self._file = open(self.path, "rb", buffering=0)
        self.file_bytes = os.fstat(self._file.fileno()).st_size
        # NOTE: a chunk never exceeds the file, and the last chunk of an upload also carries
        # the zero padding, hence the MAX_PAD spare bytes
        self.chunk_bytes = max(1, min(chunk_bytes, self.file_bytes))
        self._buffers = [cuda.pinned_array(self.chunk_bytes + MAX_PAD, np.uint8)
                         for _ in range(2)]  # (chunk_bytes + MAX_PAD,) each
        self._marks = [StreamMark(), StreamMark()]
        self._turn = 0  # the buffer the next chunk goes through
        # NOTE: reads from several threads need preadv (the seek + readinto fallback has one
        # file position)
        threaded = read_threads > 1 and hasattr(os, "preadv")
        self._pool = ThreadPoolExecutor(read_threads) if threaded else None

    def __enter__(self) -> FileUploader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def upload(self, offset: int, n_bytes: int):
        """The file's bytes [offset, offset + n_bytes) as a flat uint8 device array of
        padded_size(n_bytes) bytes whose tail past n_bytes is zero (to_device_bytes' layout)."""
        return self.upload_ranges([(offset, n_bytes)])

    def upload_ranges(self, ranges: Sequence[Piece]):
        """The concatenation of the file's byte ranges [(offset, n_bytes), ...] as one device
        array, laid out like upload() of that many bytes (e.g. tensors stacked row-wise)."""
        if self._file.closed:
            raise ValueError(f"{self.path}: the uploader is closed")
        for offset, n_bytes in ranges:
            self._check_range(offset, n_bytes)
        n_total = sum(n for _, n in ranges)
        dev = cuda.device_array(padded_size(n_total), np.uint8,
                                stream=self.stream)  # (n_total + pad,)
        chunks = chunk_pieces(ranges, self.chunk_bytes)
        done = 0
        for i, pieces in enumerate(chunks):
            pad = dev.size - n_total if i == len(chunks) - 1 else 0
            done += self._send_chunk(dev, done, pieces, pad)
        return dev

    def _check_range(self, offset: int, n_bytes: int) -> None:
        if offset < 0 or n_bytes < 0 or offset + n_bytes > self.file_bytes:
            raise ValueError(f"{self.path}: byte range {offset}..{offset + n_bytes} is outside "
                             f"the file ({self.file_bytes} bytes)")

    def _send_chunk(self, dev, at: int, pieces: list[Piece], pad: int) -> int:
        """Reads the pieces (and pad zero bytes after them) into the next staging buffer and
        queues their copy to dev[at:]; returns the bytes queued."""
        buf, mark = self._buffers[self._turn], self._marks[self._turn]
        self._turn ^= 1
        mark.wait()  # the buffer's previous copy has left it
        n = self._fill(memoryview(buf), pieces)
        buf[n:n + pad] = 0
        n += pad
        copy_to_device_async(dev[at:at + n], buf[:n], self.stream)
        mark.record(self.stream)
        return n

    def _fill(self, buf: memoryview, pieces: list[Piece]) -> int:
        """Reads the pieces one after another into buf; returns the bytes read."""
        jobs: list[tuple[memoryview, int]] = []
        n = 0
        for offset, n_bytes in pieces:
            for start in range(0, n_bytes, READ_SLICE):
                stop = min(start + READ_SLICE, n_bytes)
                jobs.append((buf[n + start:n + stop], offset + start))
            n += n_bytes
        if self._pool is None or len(jobs) < 2:
            for view, offset in jobs:
                self._read_into(view, offset)
        else:
            # NOTE: preadv releases the GIL while the kernel copies
            for _ in self._pool.map(lambda job: self._read_into(*job), jobs):
                pass
        return n

    def _read_into(self, view: memoryview, offset: int) -> None:
        got = 0
        while got < len(view):
            k = _pread_into(self._file, view[got:], offset + got)
            if k == 0:
                raise OSError(f"{self.path}: short read, {got} of {len(view)} bytes at offset "
                              f"{offset} (the file has {self.file_bytes} bytes; did it shrink?)")
            got += k

    def close(self) -> None:
        """Waits for the queued copies to leave the staging buffers, then frees them."""
        if self._file.closed:
            return
        for mark in self._marks:
            mark.wait()
            mark.close()
        if self._pool is not None:  # before the file closes: no read may outlive it
            self._pool.shutdown()
        self._file.close()
        self._buffers.clear()
        if not IS_SIMULATOR:
            # numba queues cuMemFreeHost with the device frees until ten pile up: without the
            # flush the staging would stay in the process's RSS after the load. NOTE: the queue
            # is the memory manager's, not the context's own `deallocations`
            pending = getattr(cuda.current_context().memory_manager, "deallocations", None)
            if pending is not None:
                pending.clear()


def _pread_into(file, view: memoryview, offset: int) -> int:
    """Reads up to len(view) bytes at offset into view; the bytes read (0 at end of file)."""
    if hasattr(os, "preadv"):
        return os.preadv(file.fileno(), [view], offset)
    file.seek(offset)
    return file.readinto(view) or 0

