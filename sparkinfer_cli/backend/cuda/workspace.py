"""Device buffers of one forward shape, and the per-step inputs copied into them.

A forward pass of N new tokens runs on n_rows = the power of two ≥ N rows (padding rows are
harmless: position 0 in the cache's scratch block, no recurrent tokens), laid out for the GEMVs as
(groups, cols, features) with cols = min(n_rows, 8). Everything a CUDA graph reads lives here, so a
captured decode step replays over the same pointers: per step only the int32 inputs (token ids,
positions, block tables, slots, ...) are copied in, as one transfer (plus `h`, the embeddings,
where the host looks them up).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda

from sparkinfer_cli.backend.cuda.cache import PoolShape, device_zeros
from sparkinfer_cli.backend.cuda.linears import LINEAR_MMA_MIN_ROWS
from sparkinfer_cli.kernels.cuda import gated_delta_chunked, gemm_f16, sampling
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.attention import DecodeWorkspace
from sparkinfer_cli.kernels.cuda.expert_route import ExpertRoute
from sparkinfer_cli.kernels.cuda.runtime.driver_calls import copy_to_device_async
from sparkinfer_cli.kernels.cuda.runtime.graphs import is_side_stream
from sparkinfer_cli.kernels.cuda.runtime.launch import next_pow2
from sparkinfer_cli.model.batch import (
    ALL_ALLOWED,
    ARGMAX,
    SamplingRows,
    SequenceBatch,
    mask_words,
)

MAX_COLS = qg.MAX_COLS
INT_FIELDS = ("token_ids", "positions", "seq_lens", "slot_mapping", "row_seq", "state_slots",
              "seq_lo", "seq_n", "logit_rows", "row_state_slots", "chunk_lo", "chunk_n")
# Decode passes queued before the host reads the first one's ids (CudaModel.decode_greedy): each
# has its own pinned staging of the pass's inputs and of the ids that come back.
MAX_QUEUED_STEPS = 8


def row_bucket(n: int) -> int:
    """Rows a pass of n tokens runs on: the next power of two."""
    return next_pow2(n)


@dataclass
class Act:
    """GEMV input: float32 (groups, cols, k), plus its q8 form (None in exact mode)."""
    f: Any  # float32 device array
    q: qg.QuantizedActivations | None

    def quantize(self, stream) -> None:
        if self.q is not None:
            qg.quantize_activations(self.f, self.q, stream=stream)

    def for_matrix(self, w: qg.DeviceQuantMatrix):
        return self.f if w.takes_float_activations else self.q

    def as_rows(self) -> Act:
        """The same buffers seen as (rows, 1, k): one GEMV slot per token (expert GEMVs)."""
        groups, cols, k = self.f.shape
        q = copy.copy(self.q)
        if q is not None:
            q.shape = (groups * cols, 1, k)
        return Act(self.f.reshape(groups * cols, 1, k), q)


class DeviceSampling:
    """sampling.sample's per-row inputs and its output ids (n_rows,): argmax (temperature 0) over
    every token on every row until `stage` uploads a pass's sampling rows (and grammar masks)."""

    def __init__(self, n_rows: int, n_vocab: int):
        # temperature, top_p, min_p, uniform; and top_k: pinned staging and their device copies
        self._floats_host = cuda.pinned_array((4, n_rows), np.float32)
        self._top_k_host = cuda.pinned_array(n_rows, np.int32)
        self._fill(None)
        self._floats = cuda.to_device(self._floats_host)
        self._top_k = cuda.to_device(self._top_k_host)
        f = self._floats
        self.params = (f[0], self._top_k, f[1], f[2], f[3])  # sampling.sample's argument order
        self._is_greedy = True
        # a bit per token a row may pick (structured answers); all set on the other rows
        self._allowed_host = cuda.pinned_array((n_rows, mask_words(n_vocab)), np.uint32)
        self._allowed_host[:] = ALL_ALLOWED
        self.allowed = cuda.to_device(self._allowed_host)
        self._is_masked = False
        self.ids = cuda.device_array(n_rows, np.int32)
        # where the ids come back: a row per queued decode step
        self.ids_host = cuda.pinned_array((MAX_QUEUED_STEPS, n_rows), np.int32)
        self.workspace = sampling.SamplingWorkspace(n_rows, n_vocab)

    def stage(self, rows: SamplingRows | None, stream) -> None:
        """Queue this pass's draws for the first len(rows) rows, argmax on the rest; None: argmax
        on all (copied only after a pass that sampled)."""
        if rows is None and self._is_greedy:
            return
        self._fill(rows)
        copy_to_device_async(self._floats, self._floats_host, stream)
        copy_to_device_async(self._top_k, self._top_k_host, stream)
        self._is_greedy = rows is None
        masks = None if rows is None else rows.allowed
        if masks is not None or self._is_masked:
            self._allowed_host[:] = ALL_ALLOWED
            if masks is not None:
                self._allowed_host[:len(masks)] = masks
            copy_to_device_async(self.allowed, self._allowed_host, stream)
            self._is_masked = masks is not None

    def _fill(self, rows: SamplingRows | None) -> None:
        f, k = self._floats_host, self._top_k_host
        f[0], f[1], f[2], f[3], k[:] = ARGMAX.temperature, ARGMAX.top_p, ARGMAX.min_p, 0.0, \
            ARGMAX.top_k
        if rows is not None:
            n = len(rows)
            f[0, :n], k[:n], f[1, :n], f[2, :n], f[3, :n] = (rows.temperature, rows.top_k,
                                                             rows.top_p, rows.min_p, rows.uniform)

    @property
    def nbytes(self) -> int:
        ws = self.workspace
        return sum(a.nbytes for a in (self._floats, self._top_k, self.allowed, self.ids, ws.cand_v,
                                      ws.cand_i))


class Workspace:
    def __init__(self, n_rows: int, pool: PoolShape, n_embd: int, quantized: bool,
                 n_heads: int, head_dim: int, lists_chunks: bool = False):
        """lists_chunks: fill writes the chunk list of multi-token passes (chunk_lo, chunk_n),
        for a model whose Gated DeltaNet layers run the chunked kernels."""
        self.n_rows, self.pool, self.quantized = n_rows, pool, quantized
        self.lists_chunks = lists_chunks
        self._bufs: dict[tuple, Any] = {}
        self.cols = min(n_rows, MAX_COLS)
        self.groups = n_rows // self.cols
        self.table_width = pool.num_blocks + 1
        n_ints = len(INT_FIELDS) * n_rows + n_rows * self.table_width
        # pinned staging of the int inputs (fields·rows + rows·width,), one per queued decode
        # pass, made on first use (a prefill bucket needs one: its tables take rows · width)
        self._ints_host: list[np.ndarray] = []
        self._ints_used: list[int] = []  # per staging row: the leading ints its pass reads
        self.ints = cuda.device_array(n_ints, np.int32)
        views = [self.ints[i * n_rows:(i + 1) * n_rows] for i in range(len(INT_FIELDS))]
        self.token_ids, self.positions, self.seq_lens, self.slot_mapping, self.row_seq, \
            self.state_slots, self.seq_lo, self.seq_n, self.logit_rows, \
            self.row_state_slots, self.chunk_lo, self.chunk_n = views
        # row_state_slots: SequenceBatch.draft_state_slots; chunk_lo / chunk_n: the chunked
        # Gated DeltaNet kernels' list of a multi-token pass's chunks (gated_delta_chunked)
        self.block_tables = self.ints[len(INT_FIELDS) * n_rows:].reshape(n_rows, self.table_width)
        self._h_host: np.ndarray | None = None  # pinned, made when the host looks rows up
        self._rows_in_host: np.ndarray | None = None  # pinned, made when a pass reads rows_in
        self.h = device_zeros((self.groups, self.cols, n_embd), np.float32)  # residual stream
        self.delta = self.buf("delta", self.groups, self.cols, n_embd)  # sub-layer output
        self.x = self.act("x", n_embd)  # normed sub-layer input
        # Passes of fewer rows than the GEMMs take compute every row as its decode would (GEMVs
        # in their matrix's order, the decode attention kernel at the splits of a decode pass of
        # the pass's sequences, the delta rule a token at a time): a decode's drafts and its
        # re-fed tokens are checked with the numbers their decodes would have had.
        self.rows_as_decodes = n_rows < LINEAR_MMA_MIN_ROWS
        self.attn = DecodeWorkspace(n_rows, n_heads, head_dim, pool.max_context,
                                    split_rows=1 if self.rows_as_decodes else None) \
            if n_heads else None
        self.multi_token = False  # set per pass: some sequence brings several new tokens
        # set per pass: the rows whose decode pass sets the attention's splits (rows_as_decodes:
        # the row bucket of the pass's sequences)
        self.split_rows = n_rows
        self.host_embeddings = True  # set per pass: h comes from the host, not the device lookup

    @property
    def prefill_kernels(self) -> bool:
        """Whether this pass runs the prefill kernels (tiled attention, the delta rule over
        prepared inputs): some sequence brings several tokens and the rows need not be decodes'."""
        return self.multi_token and not self.rows_as_decodes

    # ---- lazily created buffers (all exist after one eager pass, before any capture) ----------
    def buf(self, name: str, *shape: int, dtype=np.float32):
        key = (name, shape, np.dtype(dtype).str)
        if key not in self._bufs:
            self._bufs[key] = device_zeros(shape, dtype)
        return self._bufs[key]

    def act(self, name: str, k: int, groups: int | None = None, cols: int | None = None) -> Act:
        groups, cols = groups or self.groups, cols or self.cols
        key = ("act", name, groups, cols, k)
        if key not in self._bufs:
            q = qg.QuantizedActivations(groups, cols, k) if self.quantized else None
            self._bufs[key] = Act(self.buf(name, groups, cols, k), q)
        return self._bufs[key]

    def sampling(self, n_rows: int, n_vocab: int) -> DeviceSampling:
        """Device buffers that turn n_rows rows of logits into token ids (sampling.sample)."""
        key = ("greedy", n_rows)
        if key not in self._bufs:
            self._bufs[key] = DeviceSampling(n_rows, n_vocab)
        return self._bufs[key]

    @property
    def rows_in(self):
        """(groups, cols, n_embd) floats a row that a pass reads beside its tokens (the MTP
        head's hidden states), copied in by stage_rows_in."""
        return self.buf("rows_in", *self.h.shape)

    def stage_rows_in(self, rows: np.ndarray, stream) -> None:
        """Queue the copy of rows (N, n_embd) into rows_in, zeros on the padding rows."""
        if self._rows_in_host is None:
            self._rows_in_host = cuda.pinned_array(self.h.shape, np.float32)
        host = self._rows_in_host.reshape(self.n_rows, -1)
        host[:len(rows)], host[len(rows):] = rows, 0
        copy_to_device_async(self.rows_in, self._rows_in_host, stream)

    def iota(self, n: int, div: int = 1):
        """Static int32 (n,) = arange(n) // div (GEMV slot → activation group)."""
        key = ("iota", n, div)
        if key not in self._bufs:
            self._bufs[key] = cuda.to_device((np.arange(n) // div).astype(np.int32))
        return self._bufs[key]

    def expert_route(self, n_expert: int, n_slots: int, tile: int) -> ExpertRoute:
        """Device buffers that sort this pass's n_slots expert picks by expert, in tiles."""
        key = ("route", n_expert, n_slots, tile)
        if key not in self._bufs:
            self._bufs[key] = ExpertRoute(n_expert, n_slots, tile)
        return self._bufs[key]

    def gemm_partials(self, n: int, stream):
        """A split-K GEMM's scratch of n floats (None for 0): one buffer per size and stream
        (main / side), so products that may run at once never share one, and each exists after
        the first eager pass (no allocation while capturing)."""
        if n == 0:
            return None
        return self.buf("mma.partials.side" if is_side_stream(stream) else "mma.partials", n)

    def half_activations(self, x, stream):
        """x's float32 values as f16 pairs (gemm_f16's input), in a buffer per size and stream
        (main / side: products that may run at once never share one)."""
        out = self.buf("x16.side" if is_side_stream(stream) else "x16", x.size // 2,
                       dtype=np.uint32)
        gemm_f16.to_f16(x, out, stream)
        return out

    def zeros_i32(self, n: int):
        return self.buf("zeros_i32", n, dtype=np.int32)

    def memory_bytes(self) -> int:
        q8 = [b.q for b in self._bufs.values() if isinstance(b, Act) and b.q is not None]
        arrays = [b for b in self._bufs.values() if not isinstance(b, Act)]
        arrays += [a for q in q8 for a in (q.xq, q.xd, q.xs)]
        attn = [self.attn.part_m, self.attn.part_l, self.attn.part_acc] if self.attn else []
        return sum(a.nbytes for a in arrays + attn) + self.ints.nbytes + self.h.nbytes

    # ---- per-step inputs -----------------------------------------------------------------------
    def fill(self, batch: SequenceBatch, embeddings: np.ndarray | None, step: int = 0) -> None:
        """Write this pass's int32 inputs (token ids: -1 on padding rows) into staging row `step`,
        and the embeddings (N, n_embd) when the host looked them up (else the device does)."""
        pool, n_rows, N, S = self.pool, self.n_rows, len(batch.token_ids), batch.num_seqs
        ints = self._staging(step)
        f = {name: ints[i * n_rows:(i + 1) * n_rows] for i, name in enumerate(INT_FIELDS)}
        tables = ints[len(INT_FIELDS) * n_rows:].reshape(n_rows, self.table_width)
        # NOTE: only the tables of the S sequences and of the padding rows' sequence S are read;
        # a pool of 16k blocks makes every row 64 kB, so the rest is neither filled nor copied
        num_tables = min(S + 1, n_rows)
        tables[:num_tables] = pool.scratch_block
        self._ints_used[step] = len(INT_FIELDS) * n_rows + num_tables * self.table_width
        pos = batch.positions()  # (N,)
        seq_of_row = np.repeat(np.arange(S), batch.num_new_tokens)  # (N,)
        blocks = np.empty(N, np.int64)
        for i, bt in enumerate(batch.block_tables):
            tables[i, :len(bt)] = bt
        blocks[:] = tables[seq_of_row, pos // pool.block_size]
        f["token_ids"][:N], f["token_ids"][N:] = batch.token_ids, -1
        f["positions"][:N], f["positions"][N:] = pos, 0
        f["seq_lens"][:N], f["seq_lens"][N:] = pos + 1, 1
        f["slot_mapping"][:N] = blocks * pool.block_size + pos % pool.block_size
        f["slot_mapping"][N:] = pool.scratch_block * pool.block_size
        f["row_seq"][:N], f["row_seq"][N:] = seq_of_row, S  # row S (< n_rows) is all scratch
        f["state_slots"][:S] = batch.state_slots or 0
        f["state_slots"][S:] = pool.scratch_slot
        f["seq_lo"][:S], f["seq_lo"][S:] = batch.token_offsets()[:-1], 0
        f["seq_n"][:S], f["seq_n"][S:] = batch.num_new_tokens, 0
        rows = batch.logit_rows()
        f["logit_rows"][:len(rows)], f["logit_rows"][len(rows):] = rows, 0
        f["row_state_slots"][:] = -1  # the slot that keeps the state after each row, if any
        ends = batch.token_offsets()[1:]
        for end, slots in zip(ends, batch.draft_state_slots):
            f["row_state_slots"][end - 1 - len(slots):end - 1] = slots
        if self.lists_chunks and N > S:  # a multi-token pass: it may run the chunked kernels
            gated_delta_chunked.chunk_list(f["seq_lo"][:S], f["seq_n"][:S], f["chunk_lo"],
                                           f["chunk_n"])
        self.host_embeddings = embeddings is not None
        if embeddings is not None:
            if self._h_host is None:
                self._h_host = cuda.pinned_array(self.h.shape, np.float32)
            h = self._h_host.reshape(n_rows, -1)
            h[:N], h[N:] = embeddings, 0

    def _staging(self, step: int) -> np.ndarray:
        while len(self._ints_host) <= step:
            self._ints_host.append(cuda.pinned_array(self.ints.size, np.int32))
            self._ints_used.append(self.ints.size)
        return self._ints_host[step]

    def upload(self, stream, step: int = 0) -> None:
        """Queue the copies of staging row `step` (and of the host's embeddings) to the device."""
        n = self._ints_used[step]
        copy_to_device_async(self.ints[:n], self._ints_host[step][:n], stream)
        if self.host_embeddings:
            copy_to_device_async(self.h, self._h_host, stream)
