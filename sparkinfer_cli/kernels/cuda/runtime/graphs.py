"""CUDA graph capture of a chain of numba kernel launches over static buffers (cuda.core).

Usage: run the chain once eagerly (compiles every kernel and creates lazily-allocated buffers;
neither may happen while capturing), then `g = capture(record, stream)` where `record(s)` launches
the chain on stream-like `s`, and `g.replay()` per step. Arguments are frozen at capture: anything
that changes per step (positions, lengths, block tables, token ids) must live in device buffers
the graph reads.
"""

from __future__ import annotations

import functools
from typing import Callable

from cuda.bindings import driver
from cuda.core import Device, Stream
from numba import cuda

from sparkinfer_cli.kernels.cuda.runtime.driver_calls import check, stream_handle
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import IS_SIMULATOR


def core_stream(numba_stream) -> Stream:
    """The cuda.core view of a numba stream (same CUstream handle)."""
    return Stream.from_handle(stream_handle(numba_stream))


class SideStream:
    """A second stream for launches that may run beside the main chain (small kernels that each
    fill only part of the GPU). `fork(main)` returns the side stream, ordered after everything
    queued on `main` so far; `join(main)` orders `main`'s later work after the side's. Works
    eagerly and under graph capture, where the two event edges become graph dependencies. The
    simulator runs one stream: fork returns `main` and join does nothing."""

    def __init__(self):
        self.stream = cuda.stream()
        flags = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._forked = check(driver.cuEventCreate(flags))
        self._joined = check(driver.cuEventCreate(flags))

    def fork(self, main):
        check(driver.cuEventRecord(self._forked, stream_handle(main)))
        check(driver.cuStreamWaitEvent(stream_handle(self.stream), self._forked, 0))
        return self.stream

    def join(self, main) -> None:
        check(driver.cuEventRecord(self._joined, stream_handle(self.stream)))
        check(driver.cuStreamWaitEvent(stream_handle(main), self._joined, 0))


class SameStream:
    """SideStream's stand-in that keeps every launch on the main stream."""

    def fork(self, main):
        return main

    def join(self, main) -> None:
        pass


@functools.cache
def side_stream() -> SideStream | SameStream:
    """The process's side stream (one is enough: forward passes are queued from one thread)."""
    return SameStream() if IS_SIMULATOR else SideStream()


def is_side_stream(stream) -> bool:
    """Whether launches on `stream` go to the process's side stream (see SideStream.fork)."""
    side = side_stream()
    return isinstance(side, SideStream) and stream is side.stream


class CapturedGraph:
    """An instantiated graph bound to the stream it replays on."""

    def __init__(self, graph, stream: Stream):
        self._graph = graph
        self._stream = stream

    def replay(self) -> None:
        self._graph.launch(self._stream)

    def close(self) -> None:
        self._graph.close()


def capture(record: Callable[[object], None], numba_stream) -> CapturedGraph:
    """Capture every kernel `record(builder)` launches on `builder` into one graph."""
    Device().set_current()
    stream = core_stream(numba_stream)
    builder = stream.create_graph_builder()
    builder.begin_building()
    try:
        record(builder)
    finally:
        graph = builder.end_building().complete()
    return CapturedGraph(graph, stream)
