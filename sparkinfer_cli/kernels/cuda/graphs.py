"""CUDA graph capture of a chain of numba kernel launches over static buffers (cuda.core).

Usage: run the chain once eagerly (compiles every kernel and creates lazily-allocated buffers;
neither may happen while capturing), then `g = capture(record, stream)` where `record(s)` launches
the chain on stream-like `s`, and `g.replay()` per step. Arguments are frozen at capture: anything
that changes per step (positions, lengths, block tables, token ids) must live in device buffers
the graph reads.
"""

from __future__ import annotations

from typing import Callable

from cuda.core import Device, Stream


def core_stream(numba_stream) -> Stream:
    """The cuda.core view of a numba stream (same CUstream handle)."""
    handle = numba_stream.handle
    return Stream.from_handle(int(getattr(handle, "value", handle)))


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
