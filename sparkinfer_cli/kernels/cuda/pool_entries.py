"""Copy or zero one entry (a KV block, a recurrent-state slot) of a cache pool in every layer at
once: one launch on the model's stream.

A pool is one device array (layers, entries, ...) whose per-layer views the model's kernels read.
A copy or memset through the driver per layer costs a call from Python each (and, on the default
stream, a wait for the model's stream every time); under load the engine snapshots and resets
state slots many times a step, so one launch per pool keeps that off the request path.
"""

from __future__ import annotations

from numba import cuda

from sparkinfer_cli.kernels.cuda.runtime.intrinsics import chain_start
from sparkinfer_cli.kernels.cuda.runtime.jit import kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv

THREADS = 256
MAX_BLOCKS = 1024  # grid-stride beyond: enough blocks to copy at the memory's bandwidth


@kernel
def _copy_entry_kernel(pool, src, dst):
    chain_start()
    n = pool.shape[2]
    for i in range(cuda.grid(1), pool.shape[0] * n, cuda.gridsize(1)):
        layer = i // n
        e = i - layer * n
        pool[layer, dst, e] = pool[layer, src, e]


@kernel
def _zero_entry_kernel(pool, entry):
    chain_start()
    n = pool.shape[2]
    for i in range(cuda.grid(1), pool.shape[0] * n, cuda.gridsize(1)):
        layer = i // n
        pool[layer, entry, i - layer * n] = 0


def flat_pool(pool):
    """The (layers, entries, values) view of a pool (layers, entries, ...) the launches take."""
    return pool.reshape(pool.shape[0], pool.shape[1], -1)


def _grid(pool) -> int:
    return min(cdiv(pool.shape[0] * pool.shape[2], THREADS), MAX_BLOCKS)


def _check_entry(pool, *entries: int) -> None:
    for entry in entries:
        if not 0 <= entry < pool.shape[1]:
            raise ValueError(f"entry {entry} is outside the pool's {pool.shape[1]}")


def copy_entry(pool, src: int, dst: int, stream=0) -> None:
    """pool[:, dst] ← pool[:, src] for a flat_pool view, queued on stream."""
    _check_entry(pool, src, dst)
    if src != dst:
        _copy_entry_kernel[_grid(pool), THREADS, stream](pool, src, dst)


def zero_entry(pool, entry: int, stream=0) -> None:
    """pool[:, entry] ← 0 for a flat_pool view, queued on stream."""
    _check_entry(pool, entry)
    _zero_entry_kernel[_grid(pool), THREADS, stream](pool, entry)
