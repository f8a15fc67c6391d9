"""CUDA split-K decode attention over a paged KV cache vs float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import attention, attention_mma
from sparkinfer_cli.kernels.cuda.attention import CHUNK


def paged_cache(x: np.ndarray, slots: np.ndarray, n_blocks: int, block_size: int,
                dtype=np.float16) -> np.ndarray:
    """A (n_blocks, block_size, n_kv, d) cache: token i's x at row slots[i], zeros elsewhere."""
    cache = np.zeros((n_blocks * block_size, *x.shape[1:]), dtype)
    cache[slots] = x
    return cache.reshape(n_blocks, block_size, *x.shape[1:])


class PagedKV:
    """Random K/V for sequences of the given lengths, in scattered blocks of a paged cache: k, v
    the float values attended to, k_stored, v_stored the caches the kernel reads (int8: q8_0
    with scales (k_scales, v_scales), else the same as k, v)."""

    def __init__(self, rng, lens, block_size: int, n_kv: int, head_dim: int, dtype=np.float16):
        per_seq = -(-max(lens) // block_size)
        n_blocks = len(lens) * per_seq
        self.block_table = rng.permutation(n_blocks).astype(np.int32).reshape(len(lens), per_seq)
        slots = np.array([self.block_table[s, p // block_size] * block_size + p % block_size
                          for s in range(len(lens)) for p in range(lens[s])], np.int32)
        x = [rng.standard_normal((len(slots), n_kv, head_dim)).astype(np.float32)
             for _ in range(2)]  # K, V: (tokens, n_kv, head_dim)
        self.scales = None
        if dtype == np.int8:
            stored, self.scales, x = zip(*(self._quantize(y) for y in x))
            self.k_stored, self.v_stored = (paged_cache(y, slots, n_blocks, block_size, np.int8)
                                            for y in stored)
            self.scales = [paged_cache(d, slots, n_blocks, block_size, np.float32)
                           for d in self.scales]
            dtype = np.float32
        self.k, self.v = (paged_cache(y, slots, n_blocks, block_size, dtype) for y in x)
        if self.scales is None:
            self.k_stored, self.v_stored = self.k, self.v

    @staticmethod
    def _quantize(x: np.ndarray) -> tuple:
        """q8_0 of x: int8 values, one scale per 32, and the values they stand for."""
        from sparkinfer_cli.kernels.cuda.quant_gemv import quantize_q8_reference

        q8, d, _ = quantize_q8_reference(x)
        return q8, d, (q8.reshape(*d.shape, 32) * d[..., None]).reshape(x.shape)

    def reference(self, q, seq_lens, row_seq=None) -> np.ndarray:
        """float64 attention of query row r over the first seq_lens[r] tokens of row_seq[r]; q as
        the kernel sees it (attention_mma scores q·scale rounded to f16)."""
        rows = np.arange(len(q)) if row_seq is None else row_seq
        n_kv, head_dim = self.k_stored.shape[2:]
        if attention_mma.tensor_core_group(q.shape[1], n_kv, attention.kv_kind(self.k_stored),
                                           head_dim):
            scale = np.float32(1 / np.sqrt(head_dim))
            q = (q * scale).astype(np.float16).astype(np.float64) / scale
        return attention.paged_decode_attention_reference(q, self.k, self.v,
                                                          self.block_table[rows], seq_lens)


def run(kv: PagedKV, q, seq_lens, ws, out=None, row_seq=None, act=None) -> np.ndarray:
    out = cuda.device_array(q.shape, np.float32) if out is None else out
    scales = None if kv.scales is None else [cuda.to_device(s) for s in kv.scales]
    row_seq = None if row_seq is None else cuda.to_device(np.asarray(row_seq, np.int32))
    attention.paged_decode_attention(cuda.to_device(q), cuda.to_device(kv.k_stored),
                                     cuda.to_device(kv.v_stored),
                                     cuda.to_device(kv.block_table),
                                     cuda.to_device(np.asarray(seq_lens, np.int32)), out, ws,
                                     row_seq=row_seq, scales=scales, act=act)
    return out.copy_to_host()


@pytest.mark.parametrize("block_size, n_kv, head_dim, n_heads, lens, max_context, split_len", [
    (8, 1, 32, 2, (19,), 24, 12),  # one split, 2 q heads per kv head
    # 3 splits: 390 keys as 256, 134 and none. The 256 are 2 chunks, the second with the larger
    # score (seed 4): the online softmax rescales the first. head_dim 64: a whole round of eight
    # 16-byte f16 loads
    (8, 1, 64, 1, (390,), 390, 130),
    # blocks of 4 (one kv head) and of 2 query heads (2 kv heads of 2), over 3 and 2 splits
    (8, 1, 32, 4, (300,), 300, CHUNK),
    (8, 2, 32, 4, (200, 50), 200, CHUNK),
    # 34 splits: the merge weighs more splits than a warp has lanes
    (16, 1, 32, 2, (33 * CHUNK + 5,), 33 * CHUNK + 5, CHUNK),
    pytest.param(16, 2, 256, 16, (3000, 700), 3005, 512, marks=pytest.mark.gpu),  # Qwen3.6
    # a cache sized for 32k tokens (on tensor cores: 32 splits of 2 rows × 4 kv heads, of which
    # 8 and 1 hold keys)
    pytest.param(16, 4, 128, 32, (512, 33), 32768, CHUNK, marks=pytest.mark.gpu),  # Qwen3-30B
])
@pytest.mark.slow
def test_paged_decode_matches_reference(block_size, n_kv, head_dim, n_heads, lens, max_context,
                                        split_len):
    rng = np.random.default_rng(4)
    kv = PagedKV(rng, lens, block_size, n_kv, head_dim)
    q = rng.standard_normal((len(lens), n_heads, head_dim)).astype(np.float32)
    ws = attention.DecodeWorkspace(len(lens), n_heads, head_dim, max_context, split_len)
    np.testing.assert_allclose(run(kv, q, lens, ws), kv.reference(q, lens), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n_heads, n_kv, head_dim, lens, max_context", [
    # 8 query heads on one kv head, 150 keys in 2 splits of 128 and 22: each split's 4 warps
    # take 16-key tiles (the second split's last tile holds 6 keys, 2 of its warps none)
    (8, 1, 128, (150,), 150),
    # 2 kv heads of 3 query heads (padded to 8 columns), 2 rows, K rows staged in two halves
    (6, 2, 256, (70, 1), 70),
    # 17 splits of 128 keys: the merge kernel's warps add splits w, w + 4, ... four at a time,
    # warp 0's second pass holding one live split and three masked
    (2, 1, 128, (2100,), 2100),
])
@pytest.mark.slow
def test_query_heads_of_a_kv_head_on_tensor_cores(n_heads, n_kv, head_dim, lens, max_context):
    assert attention_mma.tensor_core_group(n_heads, n_kv, attention.KV_F16, head_dim)
    rng = np.random.default_rng(11)
    kv = PagedKV(rng, lens, 16, n_kv, head_dim)
    q = rng.standard_normal((len(lens), n_heads, head_dim)).astype(np.float32)
    ws = attention.DecodeWorkspace(len(lens), n_heads, head_dim, max_context)
    np.testing.assert_allclose(run(kv, q, lens, ws), kv.reference(q, lens), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_tensor_core_kernel_rows_of_some_splits_and_none_with_q8_output():
    """A row of 200 keys (4 of its 16 splits hold 64-key rounds: the others exit, the merge weighs
    4) beside a row of none (0, and 0 in q8), the output also as q8; then the same rows at 70
    keys: the merge takes 2 splits and ignores the partials the first launch left in splits 2-3."""
    from sparkinfer_cli.kernels.cuda import quant_gemv as qg

    n_heads, n_kv, head_dim, lens = 4, 2, 128, (200, 0)
    rng = np.random.default_rng(3)
    kv = PagedKV(rng, lens, 16, n_kv, head_dim)
    q = rng.standard_normal((len(lens), n_heads, head_dim)).astype(np.float32)
    ws = attention.DecodeWorkspace(len(lens), n_heads, head_dim, 1000)
    assert ws.splits(len(lens), n_heads, n_kv, attention.MAX_SPLITS,
                     attention_mma.SPLIT_BLOCKS) == 16
    act = qg.QuantizedActivations(len(lens), 1, n_heads * head_dim)
    out = run(kv, q, lens, ws, act=act)
    np.testing.assert_allclose(out[:1], kv.reference(q[:1], lens[:1]), rtol=1e-4, atol=1e-5)
    assert not out[1].any()
    want_q8 = qg.quantize_q8_reference(out.reshape(len(lens), 1, -1))
    for got, want in zip((act.xq, act.xd, act.xs), want_q8):
        np.testing.assert_allclose(got.copy_to_host(), want.reshape(-1), rtol=1e-6, atol=1e-6)
    shorter = (70, 0)
    out = run(kv, q, shorter, ws)
    np.testing.assert_allclose(out[:1], kv.reference(q[:1], shorter[:1]), rtol=1e-4, atol=1e-5)
    assert not out[1].any()


@pytest.mark.parametrize("n_heads, n_kv, max_heads, heads", [
    (16, 2, 2, 2), (32, 4, 4, 4), (4, 2, 4, 2), (6, 2, 4, 1), (3, 3, 2, 1), (12, 1, 4, 4),
    (6, 1, 4, 2),
])
def test_a_block_serves_query_heads_of_one_kv_head(n_heads, n_kv, max_heads, heads, monkeypatch):
    monkeypatch.setattr(attention, "MAX_BLOCK_HEADS", max_heads)
    assert attention.heads_per_block(n_heads, n_kv) == heads
    assert attention.heads_per_block(n_heads, n_kv, attention.KV_I8) == 1


def test_workspace_splits_cover_max_context_in_rounds():
    assert attention.DecodeWorkspace(1, 1, 32, 32768).max_splits == attention.MAX_SPLITS
    assert attention.DecodeWorkspace(1, 1, 32, 390).max_splits == 7  # ⌈390 / MIN_SPLIT_KEYS⌉
    assert attention.DecodeWorkspace(1, 1, 32, 390, split_len=130).max_splits == 3
    assert attention.DecodeWorkspace(1, 1, 32, 8, split_len=4).max_splits == 1


@pytest.mark.slow
def test_a_small_cache_still_plans_a_split_for_each_round_of_the_tensor_core_kernel():
    # a workspace for 548 tokens (the bench's after 512) plans 9 splits, so 512 keys run as 8
    # splits of one round (attention_mma's ROUND_KEYS) as with a 32k cache, not 4 of two: each
    # split that holds keys stores a partial max per head (the rest stay NaN)
    assert attention.MIN_SPLIT_KEYS == attention_mma.ROUND_KEYS
    n_heads, lens = 8, (512,)
    rng = np.random.default_rng(8)
    kv = PagedKV(rng, lens, 16, 1, 128)
    q = rng.standard_normal((1, n_heads, 128)).astype(np.float32)
    ws = attention.DecodeWorkspace(1, n_heads, 128, 548)
    ws.part_m.copy_to_device(np.full(ws.part_m.size, np.nan, np.float32))
    np.testing.assert_allclose(run(kv, q, lens, ws), kv.reference(q, lens), rtol=1e-4, atol=1e-5)
    assert np.isfinite(ws.part_m.copy_to_host()).sum() == 8 * n_heads


def test_a_launch_takes_fewer_splits_when_its_rows_fill_the_gpu():
    """Batch 1 (Qwen3.6: 16 heads in 8 groups) splits a 32k context as far as the float kernel
    takes; 64 rows take SPLIT_BLOCKS / (64 · 8) each; a prefill-sized workspace keeps one
    split's partials (not 4096 rows × MAX_SPLITS)."""
    one, many = (attention.DecodeWorkspace(n, 16, 256, 32768) for n in (1, 64))
    assert one.splits(1, 16, 8) == attention.FLOAT_KERNEL_SPLITS < attention.MAX_SPLITS
    # attention_mma's block target: 2 kv heads × 128 splits (Qwen3.6), 4 × 64 (Qwen3-30B)
    tensor_cores = (attention.MAX_SPLITS, attention_mma.SPLIT_BLOCKS)
    assert one.splits(1, 16, 2, *tensor_cores) == attention.MAX_SPLITS
    qwen3_30b = attention.DecodeWorkspace(1, 32, 128, 32768)
    assert qwen3_30b.splits(1, 32, 4, *tensor_cores) == attention.MAX_SPLITS // 2
    assert many.splits(64, 16, 8) == attention.SPLIT_BLOCKS // 512
    prefill = attention.DecodeWorkspace(4096, 16, 256, 32768)
    assert prefill.part_m.size == 4096 * 16
    assert prefill.splits(4096, 16, 4) == 1


@pytest.mark.parametrize("dtype, n_kv, head_dim, n_heads, lens", [
    (np.float32, 1, 64, 1, (140,)),  # splits of 128 and 12 keys
    (np.int8, 2, 128, 2, (100,)),  # q8_0: attends like its dequantized values
    (np.float32, 1, 64, 4, (150,)),  # 2 query heads a block over float32 K/V
])
@pytest.mark.slow
def test_cache_types(dtype, n_kv, head_dim, n_heads, lens):
    rng = np.random.default_rng(10)
    kv = PagedKV(rng, lens, 16, n_kv, head_dim, dtype)
    q = rng.standard_normal((1, n_heads, head_dim)).astype(np.float32)
    ws = attention.DecodeWorkspace(1, n_heads, head_dim, max(lens))
    np.testing.assert_allclose(run(kv, q, lens, ws), kv.reference(q, lens), rtol=1e-4, atol=1e-5)


def test_replays_reuse_the_workspace_as_the_context_grows():
    """Like a graph replayed each decode step: the same workspace and out buffer, a longer
    context (1, then 2 of 2 splits); the last split of each (row, head) leaves its arrival
    counter at 0 for the next launch."""
    rng = np.random.default_rng(3)
    kv = PagedKV(rng, (140,), 8, 1, 128)
    ws = attention.DecodeWorkspace(1, 1, 128, 140)
    out = cuda.device_array((1, 1, 128), np.float32)
    for lens in ((20,), (140,)):
        q = rng.standard_normal((1, 1, 128)).astype(np.float32)
        np.testing.assert_allclose(run(kv, q, lens, ws, out), kv.reference(q, lens),
                                   rtol=1e-4, atol=1e-5)
        assert not ws.arrivals.copy_to_host().any()


@pytest.mark.slow
def test_rows_attend_to_their_own_lengths():
    """Query rows sharing a sequence's block-table row through row_seq, with 200 keys (2
    splits) and 1 key, beside a row of another sequence with no keys at all (its output is 0)."""
    rng = np.random.default_rng(5)
    kv = PagedKV(rng, (200, 10), 8, 1, 32)
    row_seq, lens = np.array([0, 0, 1], np.int32), np.array([200, 1, 0], np.int32)
    q = rng.standard_normal((3, 1, 32)).astype(np.float32)
    out = run(kv, q, lens, attention.DecodeWorkspace(3, 1, 32, 200), row_seq=row_seq)
    np.testing.assert_allclose(out[:2], kv.reference(q[:2], lens[:2], row_seq[:2]),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out[2], 0.0)


def test_output_also_lands_as_q8_activations():
    """act: the merge writes the output's q8 form too (the output projection's input), for rows
    with keys in two splits and a row with none (zeros)."""
    from sparkinfer_cli.kernels.cuda import quant_gemv as qg

    rng = np.random.default_rng(6)
    kv = PagedKV(rng, (150, 10), 8, 1, 64)
    lens = np.array([150, 0], np.int32)
    q = rng.standard_normal((2, 2, 64)).astype(np.float32)
    act = qg.QuantizedActivations(2, 1, 2 * 64)
    out = run(kv, q, lens, attention.DecodeWorkspace(2, 2, 64, 150), act=act)
    np.testing.assert_allclose(out[0], kv.reference(q[:1], lens[:1])[0], rtol=1e-4, atol=1e-5)
    assert not out[1].any()
    xq, xd, xs = qg.quantize_q8_reference(out.reshape(2, 1, -1))
    np.testing.assert_array_equal(act.xq.copy_to_host(), xq.reshape(-1))
    np.testing.assert_allclose(act.xd.copy_to_host(), xd.reshape(-1), rtol=1e-6)
    np.testing.assert_allclose(act.xs.copy_to_host(), xs.reshape(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_heads, n_kv, head_dim", [
    (2, 1, 32),  # this module's kernel
    (4, 2, 128),  # attention_mma's (f16, 2 query heads a kv head)
])
@pytest.mark.slow
def test_rows_at_the_splits_of_one_decode_equal_that_decode_bit_for_bit(
        n_heads, n_kv, head_dim, monkeypatch):
    """A sequence's 2 last positions as 2 query rows (a decode's fed token and a draft to check)
    with split_rows=1 give, bit for bit, what decoding each position alone gives; counted for 2
    rows, the launch takes one split instead of two and the sums differ. Block targets small
    enough for the tiny shapes to split differently at 1 and 2 rows."""
    monkeypatch.setattr(attention, "SPLIT_BLOCKS", 2)
    monkeypatch.setattr(attention_mma, "SPLIT_BLOCKS", 2 * n_kv)
    rng = np.random.default_rng(8)
    length, rows = 140, 2
    kv = PagedKV(rng, (length,), 16, n_kv, head_dim)
    q = rng.standard_normal((rows, n_heads, head_dim)).astype(np.float32)
    lens = np.arange(length - rows + 1, length + 1, dtype=np.int32)  # position + 1
    alone = np.concatenate([run(kv, q[r:r + 1], lens[r:r + 1],
                                attention.DecodeWorkspace(1, n_heads, head_dim, length))
                            for r in range(rows)])
    row_seq = np.zeros(rows, np.int32)
    ws = attention.DecodeWorkspace(rows, n_heads, head_dim, length, split_rows=1)
    together = cuda.device_array(q.shape, np.float32)
    attention.paged_decode_attention(cuda.to_device(q), cuda.to_device(kv.k_stored),
                                     cuda.to_device(kv.v_stored), cuda.to_device(kv.block_table),
                                     cuda.to_device(lens), together, ws,
                                     row_seq=cuda.to_device(row_seq), split_rows=1)
    np.testing.assert_array_equal(together.copy_to_host(), alone)
    by_rows = run(kv, q, lens, attention.DecodeWorkspace(rows, n_heads, head_dim, length),
                  row_seq=row_seq)
    assert not np.array_equal(by_rows, alone)
    np.testing.assert_allclose(by_rows, alone, rtol=1e-4, atol=1e-5)


def test_a_workspace_too_small_for_the_asked_splits_is_refused():
    """Fewer splits than split_rows asks for would change the rows' sums: an error, not a
    silently different split."""
    ws = attention.DecodeWorkspace(64, 2, 32, 4096)  # partials for 64 rows at their splits
    with pytest.raises(ValueError, match="need 64 partials a head"):
        ws.splits(64, 2, 1, split_rows=1)
    sized = attention.DecodeWorkspace(64, 2, 32, 4096, split_rows=1)
    assert sized.splits(64, 2, 1, split_rows=1) == sized.splits(1, 2, 1) == 64
