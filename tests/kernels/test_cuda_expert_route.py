"""Device routing of MoE slots by expert vs numpy counts (simulator: tiny shapes; H200: real)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import expert_route as er


def run_route(ids: np.ndarray, n_expert: int, tile: int, max_slots: int | None = None):
    route = er.ExpertRoute(n_expert, max_slots or len(ids), tile)
    er.route_experts(cuda.to_device(ids.astype(np.int32)), len(ids), route)
    return route, {name: getattr(route, name).copy_to_host() for name in (
        "order", "offsets", "tile_expert", "tile_lo", "tile_hi", "n_tiles")}


def check_route(ids: np.ndarray, n_expert: int, tile: int, route, got: dict) -> None:
    offsets, tiles = er.route_reference(ids, n_expert, tile)
    np.testing.assert_array_equal(got["offsets"], offsets)
    order = got["order"][:len(ids)]
    np.testing.assert_array_equal(np.sort(order), np.arange(len(ids)))  # every slot exactly once
    for e in range(n_expert):
        np.testing.assert_array_equal(ids[order[offsets[e]:offsets[e + 1]]], e)
    n_tiles = int(got["n_tiles"][0])
    lo, hi, expert = got["tile_lo"], got["tile_hi"], got["tile_expert"]
    assert n_tiles == len(tiles)
    assert [(int(expert[t]), int(hi[t] - lo[t])) for t in range(n_tiles)] == tiles
    for t in range(n_tiles):  # a tile lies inside its expert's run of order
        assert offsets[expert[t]] <= lo[t] < hi[t] <= offsets[expert[t] + 1]
    covered = np.concatenate([np.arange(lo[t], hi[t]) for t in range(n_tiles)] or [[]])
    np.testing.assert_array_equal(np.sort(covered), np.arange(len(ids)))
    assert len(lo) == route.max_tiles
    np.testing.assert_array_equal(lo[n_tiles:], hi[n_tiles:])  # unused tiles are empty
    assert np.all((expert[n_tiles:] >= 0) & (expert[n_tiles:] < n_expert))


def test_route_sorts_slots_into_tiles_of_one_expert(rng):
    # expert 1 has 19 slots (3 tiles of ≤ 8), experts 0 and 4 none, the others a few
    n_expert, tile = 6, 8
    ids = rng.permutation(np.array([1] * 19 + [2] * 8 + [3] * 3 + [5], np.int32))
    route, got = run_route(ids, n_expert, tile)
    check_route(ids, n_expert, tile, route, got)
    assert int(got["n_tiles"][0]) == 3 + 1 + 1 + 1


def test_route_reuses_buffers_for_fewer_slots(rng):
    # a route sized for 40 slots, used first with 40, then with 5: stale tiles must read as empty
    n_expert, tile = 8, 4
    route = er.ExpertRoute(n_expert, 40, tile)
    for n_slots in (40, 5):
        ids = rng.integers(0, n_expert, n_slots).astype(np.int32)
        er.route_experts(cuda.to_device(ids), n_slots, route)
        got = {name: getattr(route, name).copy_to_host() for name in (
            "order", "offsets", "tile_expert", "tile_lo", "tile_hi", "n_tiles")}
        check_route(ids, n_expert, tile, route, got)


def test_route_with_more_experts_than_threads(rng):
    # 70 experts over the simulator's 32 threads: each thread scans a run of experts
    n_expert, tile = 70, 2
    ids = rng.integers(0, n_expert, 50).astype(np.int32)
    ids[:7] = 69  # the last expert gets several tiles
    route, got = run_route(ids, n_expert, tile)
    check_route(ids, n_expert, tile, route, got)


def test_route_rejects_too_many_slots():
    route = er.ExpertRoute(4, 8, 8)
    with pytest.raises(ValueError, match="do not fit"):
        er.route_experts(cuda.to_device(np.zeros(9, np.int32)), 9, route)
    with pytest.raises(ValueError, match="experts"):
        er.ExpertRoute(2000, 8, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("n_slots, tile", [(512, 8), (8, 8), (4096 * 8, 128)])
def test_route_real_shapes(rng, n_slots, tile):
    # Qwen3.6: 256 experts, top-8; batch 64 decode, batch 1, and a 4096-token prefill
    n_expert = 256
    ids = rng.integers(0, n_expert, n_slots).astype(np.int32)
    ids[: n_slots // 8] = 7  # one hot expert with many tiles
    route, got = run_route(ids, n_expert, tile)
    check_route(ids, n_expert, tile, route, got)


def test_route_buffers_report_their_size() -> None:
    route = er.ExpertRoute(n_expert=6, max_slots=20, tile=4)
    # order 20, offsets 7, three tile arrays of 20 // 4 + 6 = 11, n_tiles 1: int32 each
    assert route.nbytes == 4 * (20 + 7 + 3 * 11 + 1)
