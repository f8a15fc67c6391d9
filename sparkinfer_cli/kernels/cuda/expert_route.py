"""MoE slots sorted by expert on the device and cut into tiles, for the grouped expert GEMM.

A slot is one (token, expert pick) and ids[slot] its expert. Reading each selected expert once per
tile of its slots (mma_gemm.grouped_matmul, prefills) needs the slots grouped by expert.
route_experts does it in one single-block launch: shared-memory counts, a block scan, an atomic
scatter. All sizes are fixed at construction and nothing comes back to the host, so the launch can
live in a CUDA graph.

    order    [ slots of e0 | slots of e1 | ... ]         expert e: order[offsets[e]:offsets[e+1]]
    tiles    [ e0 ≤tile | e0 rest | e2 ≤tile | ... | empty (lo == hi) ... ]   n_tiles[0] in use
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int32

from sparkinfer_cli.kernels.cuda.moe import MAX_EXPERTS
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import IS_SIMULATOR, chain_start
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import check_array

MAX_THREADS = 1024
THREADS = 32 if IS_SIMULATOR else MAX_THREADS


class ExpertRoute:
    """Device buffers of one routing (allocated once, rewritten by every route_experts call)."""

    def __init__(self, n_expert: int, max_slots: int, tile: int):
        if not 1 <= n_expert <= MAX_EXPERTS:
            raise ValueError(f"expert routing takes 1..{MAX_EXPERTS} experts, got {n_expert}")
        if max_slots < 1 or tile < 1:
            raise ValueError(f"max_slots ({max_slots}) and tile ({tile}) must be ≥ 1")
        self.n_expert, self.max_slots, self.tile = n_expert, max_slots, tile
        # NOTE: Σ_e ceil(count_e / tile) ≤ max_slots // tile + n_expert, so no routing overflows
        self.max_tiles = max_slots // tile + n_expert
        self.order = cuda.device_array(max_slots, np.int32)  # (max_slots,)
        self.offsets = cuda.device_array(n_expert + 1, np.int32)  # (n_expert + 1,)
        self.tile_expert = cuda.device_array(self.max_tiles, np.int32)  # (max_tiles,)
        self.tile_lo = cuda.device_array(self.max_tiles, np.int32)  # (max_tiles,)
        self.tile_hi = cuda.device_array(self.max_tiles, np.int32)  # (max_tiles,)
        self.n_tiles = cuda.device_array(1, np.int32)  # (1,)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.order, self.offsets, self.tile_expert, self.tile_lo,
                                      self.tile_hi, self.n_tiles))

    def tiles_bound(self, n_slots: int) -> int:
        """How many tiles a routing of n_slots slots can use at most (a consumer's grid size)."""
        return min(self.max_tiles, n_slots // self.tile + min(self.n_expert, n_slots))


@device_function
def _block_exclusive_scan(v, buf):
    """(Σ of v over threads before this one, Σ over all threads); buf: int32 shared ≥ blockDim."""
    tid, n = cuda.threadIdx.x, cuda.blockDim.x
    buf[tid] = v
    cuda.syncthreads()
    step = 1
    while step < n:  # Hillis-Steele: log2(blockDim) rounds
        add = buf[tid - step] if tid >= step else 0
        cuda.syncthreads()
        buf[tid] += add
        cuda.syncthreads()
        step *= 2
    inclusive, total = buf[tid], buf[n - 1]
    cuda.syncthreads()  # buf may be reused right after
    return inclusive - v, total


@device_function
def _write_tiles(e, first_slot, count, first_tile, tile, tile_expert, tile_lo, tile_hi):
    """Expert e's slots [first_slot, first_slot + count) as tiles of ≤ tile from first_tile on."""
    for j in range((count + tile - 1) // tile):
        tile_expert[first_tile + j] = e
        tile_lo[first_tile + j] = first_slot + j * tile
        tile_hi[first_tile + j] = first_slot + min((j + 1) * tile, count)


@kernel
def _route_kernel(ids, n_slots, n_expert, tile, max_tiles, order, offsets, tile_expert, tile_lo,
                  tile_hi, n_tiles):
    chain_start()
    # one block; thread t owns a contiguous run of experts for the scan and tile writing
    count = cuda.shared.array(MAX_EXPERTS, int32)  # slots per expert, then the scatter cursor
    scan = cuda.shared.array(MAX_THREADS, int32)
    tid, n_threads = cuda.threadIdx.x, cuda.blockDim.x
    for e in range(tid, n_expert, n_threads):
        count[e] = 0
    cuda.syncthreads()
    for s in range(tid, n_slots, n_threads):
        cuda.atomic.add(count, ids[s], 1)
    cuda.syncthreads()
    per = (n_expert + n_threads - 1) // n_threads
    e_lo = min(tid * per, n_expert)
    e_hi = min(e_lo + per, n_expert)
    my_slots, my_tiles = 0, 0
    for e in range(e_lo, e_hi):
        my_slots += count[e]
        my_tiles += (count[e] + tile - 1) // tile
    slot, total_slots = _block_exclusive_scan(my_slots, scan)
    first_tile, total_tiles = _block_exclusive_scan(my_tiles, scan)
    for e in range(e_lo, e_hi):
        c = count[e]
        offsets[e] = slot
        _write_tiles(e, slot, c, first_tile, tile, tile_expert, tile_lo, tile_hi)
        count[e] = slot  # only this thread reads count[e] before the barrier below
        slot += c
        first_tile += (c + tile - 1) // tile
    if tid == 0:
        offsets[n_expert] = total_slots
        n_tiles[0] = total_tiles
    for t in range(total_tiles + tid, max_tiles, n_threads):  # empty tiles: lo == hi, expert 0
        tile_expert[t] = 0
        tile_lo[t] = total_slots
        tile_hi[t] = total_slots
    cuda.syncthreads()
    for s in range(tid, n_slots, n_threads):
        order[cuda.atomic.add(count, ids[s], 1)] = s


def route_experts(ids, n_slots: int, route: ExpertRoute, stream=0) -> None:
    """ids: int32 device (n_slots,) expert of each slot → route.order / offsets / tiles.

    NOTE: ids must lie in [0, route.n_expert) (the router guarantees it; nothing checks on device).
    """
    if not 0 <= n_slots <= route.max_slots:
        raise ValueError(f"{n_slots} slots do not fit a route of {route.max_slots}")
    check_array("ids", ids, np.int32, (n_slots,))
    _route_kernel[1, THREADS, stream](
        ids, n_slots, route.n_expert, route.tile, route.max_tiles, route.order, route.offsets,
        route.tile_expert, route.tile_lo, route.tile_hi, route.n_tiles)


def route_reference(ids: np.ndarray, n_expert: int, tile: int) -> tuple[np.ndarray, list]:
    """(offsets (n_expert + 1,), [(expert, n slots)] per tile in expert order), numpy."""
    counts = np.bincount(ids, minlength=n_expert)  # (n_expert,)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)  # (n_expert + 1,)
    tiles = [(e, min(tile, c - j)) for e, c in enumerate(counts) for j in range(0, c, tile)]
    return offsets, tiles
