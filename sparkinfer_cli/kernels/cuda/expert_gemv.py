"""MoE expert GEMV over tiles of slots that picked the same expert (decode batches).

y[slot] = W[expert(slot)] · x[slot_x[slot]] for every slot, as quant_gemv.gemv with slot_mat =
the slots' experts, but a block takes one tile of ≤ TILE slots of one expert (expert_route's
order, cut into tiles) and dots each weight row it loads with all of the tile's activations:
an expert picked by several of a batch's tokens is read and unpacked once for them, not once
per slot. Columns of a tile past its slots re-read the tile's last slot and store nothing.

The grid is fixed (graph replays see another routing every step): grid.x blocks walk the route's
tiles in use (route.n_tiles, on the device) with stride grid.x, grid.y blocks walk the row blocks.
"""

from __future__ import annotations

import functools

from numba import cuda, int32

from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.expert_route import ExpertRoute

# Slots a block dots each weight row with (the kernel's activation columns). ptxas sm_90, Q4_K
# fused SwiGLU: 104 registers at 2 (4 blocks an SM), 118 at 3, 150 at 4 (3 blocks). At 64
# sequences an expert holds ~2 of the 512 slots: 2-slot tiles read ~1.3× the touched experts'
# bytes, 4-slot ones ~1.05× at lower occupancy. Not yet measured on the GPU.
TILE = 2


@functools.cache
def _tile_kernel(ggml_type, swiglu: bool, rows_per_lane: int):
    block_rows = qg.block_rows_fn(ggml_type, TILE, swiglu, rows_per_lane)

    @cuda.jit(fastmath=True)
    def expert_tiles(w, w2, row_bytes, n_rows, mat_bytes, k, lanes_per_row, row_warps,
                     n_row_blocks, tile_expert, tile_lo, tile_hi, n_tiles, order, slot_x, xq, xd,
                     xs, y0, y1, y2, y3, ends):
        xcol = cuda.local.array(TILE, int32)  # (TILE,) element offsets into x
        ycol = cuda.local.array(TILE, int32)  # (TILE,) output slots, -1: none
        for t in range(cuda.blockIdx.x, n_tiles[0], cuda.gridDim.x):  # block-uniform
            lo, hi = tile_lo[t], tile_hi[t]
            for c in range(TILE):
                slot = order[min(lo + c, hi - 1)]
                xcol[c] = slot_x[slot] * k
                ycol[c] = slot if lo + c < hi else -1
            for row_block in range(cuda.blockIdx.y, n_row_blocks, cuda.gridDim.y):
                block_rows(w, w2, row_bytes, n_rows, tile_expert[t] * mat_bytes, k,
                           lanes_per_row, row_warps, row_block, xcol, ycol, xq, xd, xs, y0,
                           False, y0, y1, y2, y3, ends)
                if row_warps > 1:
                    cuda.syncthreads()  # reduce_rows' shared partials are rewritten next round
    return expert_tiles


def expert_gemv(w: qg.DeviceQuantMatrix, x, y, route: ExpertRoute, slot_x, *,
                up: qg.DeviceQuantMatrix | None = None, stream=0) -> None:
    """y (n_slots, 1, n_rows) f32 ← W[expert(slot)] · x[slot_x[slot]] for the slots that
    route_experts sorted into `route` (tile size TILE); x: (n_groups, 1, k) activations as
    quant_gemv.gemv takes them; up: fused SwiGLU, y = silu(W·x) ⊙ (up·x)."""
    if route.tile != TILE:
        raise ValueError(f"expert_gemv takes routes of {TILE}-slot tiles, got {route.tile}")
    qg.check_up(w, up)
    xq, xd, xs, n_cols = qg.activation_args(w, x)
    if n_cols != 1:
        raise ValueError(f"expert_gemv takes one activation column a group, got {n_cols}")
    parts, ends = qg.output_parts(y, y.shape[0], 1, w.n_rows)
    tile_blocks = min(route.max_tiles, route.n_expert)  # about the tiles a routing fills
    g = qg.RowGeometry.of(w, TILE, tile_blocks)
    kernel = _tile_kernel(w.ggml_type, up is not None, g.lane_rows)
    kernel[(tile_blocks, g.grid_y), 32 * qg.WARPS_PER_BLOCK, stream](
        w.data, w.data if up is None else up.data, w.row_bytes, w.n_rows, w.n_rows * w.row_bytes,
        w.k, g.lanes, g.warps, g.n_row_blocks, route.tile_expert, route.tile_lo, route.tile_hi,
        route.n_tiles, route.order, slot_x, xq, xd, xs, *parts, ends)
