"""The paged attention kernel against a float64 numpy reference written here, over float32 and
float16 caches: query rows of several sequences (decode tokens, and prompt rows that read the rows
stored before them in the same call) over scattered block tables, GQA groups of 1 to 8, head dims
and block sizes that are not multiples of the kernel's 8 lanes, lengths across several score tiles
and output blocks, scores large enough that most probabilities underflow; and every row's result
the same bit for bit whatever pass it shares and however the pass is split between threads."""

from __future__ import annotations

import numpy as np
import pytest

from sparkinfer_cli.kernels.cpu import paged_attention, quant
from sparkinfer_cli.kernels.cpu.paged_attention import PassRows, attend


def _reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """float64 softmax(q·Kᵀ/√D)·V of one query q (H, D) over keys, values (length, H_kv, D)."""
    H, D = q.shape
    kv_head = np.arange(H) // (H // keys.shape[1])
    scores = np.einsum("hd,thd->ht", q, keys[:, kv_head]) / np.sqrt(D)  # (H, length)
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    return np.einsum("ht,thd->hd", probs, values[:, kv_head])


def _split(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """Passes split between `threads` threads whatever their size (1: never split)."""
    monkeypatch.setattr(paged_attention, "_MIN_MACS_PER_PART", 1 if threads > 1 else 1 << 60)
    monkeypatch.setattr(quant, "_num_threads", lambda: threads)


class _Pass:
    """A cache layer of random K/V, and per sequence a scattered block table and the positions
    of its new rows; the rows' queries and new k, v."""

    def __init__(self, rng: np.random.Generator, shape: tuple[int, int, int, int],
                 rows: list[tuple[int, int]], num_blocks: int, q_scale: float = 1.0,
                 kv_dtype: type = np.float32):
        H, H_kv, D, block_size = shape
        self.block_size = block_size
        self.k = rng.standard_normal((num_blocks, block_size, H_kv, D)).astype(kv_dtype)
        self.v = rng.standard_normal((num_blocks, block_size, H_kv, D)).astype(kv_dtype)
        blocks = rng.permutation(num_blocks).astype(np.int32)
        n_seqs = max(s for s, _ in rows) + 1
        per_seq = num_blocks // n_seqs
        self.tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(n_seqs)]
        self.seqs = [s for s, _ in rows]
        self.positions = np.array([p for _, p in rows], np.int32)
        n = len(rows)
        self.q = (rng.standard_normal((n, H, D)) * q_scale).astype(np.float32)
        self.k_new = rng.standard_normal((n, H_kv, D)).astype(np.float32)
        self.v_new = rng.standard_normal((n, H_kv, D)).astype(np.float32)

    def rows(self) -> PassRows:
        return PassRows([self.tables[s] for s in self.seqs], self.positions, self.block_size)

    def run(self) -> np.ndarray:
        return attend(self.q, self.k_new, self.v_new, self.k[None], self.v[None], 0, self.rows())

    def expected(self) -> list[np.ndarray]:
        """Each row's float64 attention, with every row's k, v in the cache first (rounded to
        the cache's type)."""
        k, v = self.k.astype(np.float64), self.v.astype(np.float64)
        for i, (s, p) in enumerate(zip(self.seqs, self.positions)):
            slot = self.tables[s][p // self.block_size], p % self.block_size
            k[slot] = self.k_new[i].astype(self.k.dtype)
            v[slot] = self.v_new[i].astype(self.k.dtype)
        wants = []
        for i, (s, p) in enumerate(zip(self.seqs, self.positions)):
            pos = np.arange(p + 1)
            slot = self.tables[s][pos // self.block_size], pos % self.block_size
            wants.append(_reference(self.q[i].astype(np.float64), k[slot], v[slot]))
        return wants


# (H, H_kv, D, block_size)
SHAPES = [(6, 2, 32, 8), (9, 3, 64, 16), (16, 2, 256, 16), (4, 4, 20, 3), (8, 1, 128, 5)]


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_store_then_attend(shape: tuple[int, int, int, int], threads: int, kv_dtype: type,
                                rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows of three sequences at positions 0, 13 and 150 (three output blocks), then a
    prompt piece of the third: its rows read the k, v the call stored for the rows before. A
    float16 cache gets each new value rounded to nearest even, as numpy rounds it."""
    _split(monkeypatch, threads)
    rows = [(1, 13), (0, 0), (2, 150)] + [(2, p) for p in range(151, 160)]
    p = _Pass(rng, shape, rows, num_blocks=3 * (200 // shape[3] + 1), kv_dtype=kv_dtype)
    before = p.k.copy()
    got = p.run()
    assert got.shape == p.q.shape and got.dtype == np.float32
    for i, want in enumerate(p.expected()):
        np.testing.assert_allclose(got[i], want, rtol=2e-5, atol=2e-5)
    for i, (s, pos) in enumerate(zip(p.seqs, p.positions)):
        slot = p.tables[s][pos // p.block_size], pos % p.block_size
        np.testing.assert_array_equal(p.k[slot], p.k_new[i].astype(kv_dtype))
        np.testing.assert_array_equal(p.v[slot], p.v_new[i].astype(kv_dtype))
        before[slot] = p.k_new[i]
    np.testing.assert_array_equal(p.k, before)  # nothing else written


def test_peaked_scores(rng: np.random.Generator) -> None:
    """Queries 30× larger: most probabilities underflow to 0 in float32, the largest stay."""
    p = _Pass(rng, (8, 2, 64, 16), [(0, 300), (1, 7)], num_blocks=40, q_scale=30.0)
    got = p.run()
    for i, want in enumerate(p.expected()):
        np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_a_rows_numbers_do_not_depend_on_its_pass(shape: tuple[int, int, int, int],
                                                  rng: np.random.Generator,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A row alone on one thread, and the same row in a pass of 24 split between 2 threads."""
    rows = [(s % 4, 20 + 9 * s) for s in range(24)]
    p = _Pass(rng, shape, rows, num_blocks=4 * (250 // shape[3] + 1))
    _split(monkeypatch, 2)
    together = p.run()
    _split(monkeypatch, 1)
    for i in (0, 11, 23):
        alone = attend(p.q[i:i + 1], p.k_new[i:i + 1], p.v_new[i:i + 1], p.k[None], p.v[None], 0,
                       PassRows([p.tables[p.seqs[i]]], p.positions[i:i + 1], p.block_size))
        np.testing.assert_array_equal(alone[0], together[i])


def test_a_layer_of_the_cache_and_strided_new_rows(rng: np.random.Generator) -> None:
    """Layer 1 of a three-layer cache, the new k, v as views into one (N, 2·H_kv·D) projection
    (as the fused q/k/v output gives them), a non-contiguous q: the other layers untouched."""
    p = _Pass(rng, (6, 2, 32, 8), [(0, 40), (1, 3)], num_blocks=12)
    k, v = (np.stack([rng.standard_normal(p.k.shape).astype(np.float32), x,
                      rng.standard_normal(p.k.shape).astype(np.float32)]) for x in (p.k, p.v))
    others = k[[0, 2]].copy()
    kv = np.concatenate([p.k_new.reshape(2, -1), p.v_new.reshape(2, -1)], axis=1)
    k_new, v_new = kv[:, :64].reshape(2, 2, 32), kv[:, 64:].reshape(2, 2, 32)
    q = np.asfortranarray(p.q)
    got = attend(q, k_new, v_new, k, v, 1, p.rows())
    for i, want in enumerate(p.expected()):
        np.testing.assert_allclose(got[i], want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(k[[0, 2]], others)
    with pytest.raises(ValueError, match="layer 3"):
        attend(q, k_new, v_new, k, v, 3, p.rows())


def test_shapes_that_do_not_fit_are_refused(rng: np.random.Generator) -> None:
    p = _Pass(rng, (6, 2, 32, 8), [(0, 3)], num_blocks=4)
    k, v = p.k[None], p.v[None]
    with pytest.raises(ValueError, match="do not fit"):
        attend(p.q[:, :5], p.k_new, p.v_new, k, v, 0, p.rows())  # 5 heads over 2 KV heads
    with pytest.raises(ValueError, match="do not fit"):
        attend(p.q, p.k_new, p.v_new, k[..., :16], v[..., :16], 0, p.rows())
    with pytest.raises(ValueError, match="do not fit"):  # a cache type with no kernel
        attend(p.q, p.k_new, p.v_new, k.astype(np.float64), v.astype(np.float64), 0, p.rows())
    with pytest.raises(ValueError, match="do not fit"):
        attend(p.q, p.k_new[:, :1], p.v_new, k, v, 0, p.rows())
    with pytest.raises(ValueError, match="do not fit"):
        attend(p.q, p.k_new, p.v_new, p.k, p.v, 0, p.rows())  # one layer without its axis
    with pytest.raises(ValueError, match="block tables"):
        PassRows([p.tables[0]] * 2, p.positions, p.block_size)
