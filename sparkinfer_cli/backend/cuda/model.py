"""CudaModel: the model's forward pass on an NVIDIA GPU (numba.cuda kernels), the CPU model's
interface (ModelBackend).

    model = load_cuda_model(gguf, config)            # weights uploaded once, in their GGUF bytes
    cache = model.create_cache(num_blocks, block_size, num_state_slots)   # on the device
    logits = model.forward(batch, cache)             # float32 numpy, like the CPU model

A pass of N tokens runs on a workspace of the next power of two rows (workspace.py). Every
pass replays a CUDA graph captured the first time its kind is seen (graph_key: row bucket; one
or several tokens a sequence; logit rows; attention splits; greedy ids or logits), after one
eager run: all a pass varies is in device buffers, and a 512-token prefill's ~680 eager launches
cost more host time than its kernels take. prepare captures every kind the engine can meet
before it serves. Passes of up to DRAFT_PASS_TOKENS tokens compute every row as its decode
would (a decode's drafts are checked there, ModelBackend.scores_drafts); larger ones with
several tokens a sequence run the prefill kernels (tiled attention, the delta rule over
prepared inputs). Passes of ≥
LINEAR_MMA_MIN_ROWS tokens (a 32-sequence decode included) run every dense linear as a
tensor-core GEMM (f16 activations), from EXPERTS_MMA_MIN_ROWS on the MoE experts too
(linears.py).
Token embeddings are looked up on the device (kernels/cuda/embedding.py) from the step's token
ids, so `decode_greedy` can queue several decode passes at once, each reading the previous one's
argmax ids on the device; tables of a type without a device lookup are read on the host.

Activations: by default the GEMVs of quantized weights take q8 activations (int8 per 32, dp4a), as
llama.cpp's CUDA path does, so logits follow llama.cpp's native runs (≈1e-2). `exact=True`
uploads matrices dequantized to F32, keeps activations in float32 and the KV cache in F32 (F16 by
default): the CPU model's math (≤ 1e-3 vs llama.cpp's dequantized-F32 logits), at several times
the memory; for tests.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from numba import cuda
from rich.console import Console

from sparkinfer_cli import env
from sparkinfer_cli.backend.cuda.cache import CudaModelCache
from sparkinfer_cli.backend.cuda.layers import CudaAttention, CudaGatedDeltaNet, CudaMoE, CudaSwiGLU
from sparkinfer_cli.backend.cuda.linears import LINEAR_MMA_MIN_ROWS
from sparkinfer_cli.backend.cuda.weights import Uploader, upload_progress
from sparkinfer_cli.backend.cuda.workspace import MAX_COLS, MAX_QUEUED_STEPS, Workspace, row_bucket
from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.kernels.cuda import embedding, norm, sampling
from sparkinfer_cli.kernels.cuda.model_ops import gather_rows
from sparkinfer_cli.kernels.cuda.runtime import graphs
from sparkinfer_cli.kernels.cuda.runtime.driver_calls import (
    StreamMark,
    copy_device_async,
    copy_to_host_async,
)
from sparkinfer_cli.kernels.cuda.runtime.file_upload import FileUploader
from sparkinfer_cli.kernels.cuda.runtime.graphs import CapturedGraph
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import IS_SIMULATOR
from sparkinfer_cli.model.backend import ModelBackend, StepTimes
from sparkinfer_cli.model.batch import SamplingRows, SequenceBatch
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.layers import Embedding
from sparkinfer_cli.model.tensors import (
    DeltaNetTensors,
    LayerTensors,
    ModelTensors,
    MoETensors,
    resolve_tensors,
)
from sparkinfer_cli.model.weights import QTensor

MAX_GRAPH_ROWS = 64  # decode graphs of batches up to this many sequences are captured at load
MAX_PASS_TOKENS = 4096  # tokens a forward pass takes at most (workspace buffers are sized by it)
MIN_PROMPT_LOGIT_ROWS = MAX_COLS  # the fewest logit rows of a pass with prompt tokens
# The most tokens a pass computes as decodes (Workspace.rows_as_decodes: its row bucket is below
# LINEAR_MMA_MIN_ROWS): a pass that checks drafts stays within it.
DRAFT_PASS_TOKENS = row_bucket(LINEAR_MMA_MIN_ROWS) // 2


# graph_key: (row bucket, several tokens a sequence, logit rows, attention split rows, ids too)
GraphKey = tuple[int, bool, int, int, bool]


@dataclass
class CudaLayer:
    attn_norm: Any  # float32 device array
    mixer: CudaAttention | CudaGatedDeltaNet
    ffn_norm: Any
    ffn: CudaSwiGLU | CudaMoE


@dataclass
class CachePasses:
    """What the passes over one cache reuse: a workspace per row bucket, and the graph captured
    per pass kind (graph_key). Both point into that cache's buffers, so the model keeps them per
    cache, for as long as the cache lives."""
    workspaces: dict[int, Workspace] = field(default_factory=dict)
    graphs: dict[GraphKey, CapturedGraph] = field(default_factory=dict)


class QueuedPass(NamedTuple):
    ws: Workspace
    logit_rows: int  # the bucket of rows that produce logits
    n_logits: int  # of which real
    t0: float  # perf_counter at the start of the call
    t_queued: float  # perf_counter once the GPU work was queued
    kind: str  # "decode" (a decode pass's graph replay) | "other"


class CudaModel(ModelBackend[CudaModelCache]):
    max_pass_tokens = MAX_PASS_TOKENS  # the engine keeps each step's tokens within this
    max_queued_steps = MAX_QUEUED_STEPS  # decode passes decode_greedy queues at once
    max_sample_top_k = sampling.MAX_CANDIDATES  # forward_sampled is exact for 1 ≤ top_k ≤ this
    picks_on_device = True
    scores_drafts = True  # within max_draft_pass_tokens
    max_draft_pass_tokens = DRAFT_PASS_TOKENS
    snapshots_draft_states = True  # passes of decodes' rows (layers.CudaGatedDeltaNet)

    def __init__(self, tensors: ModelTensors, config: ModelConfig, *, exact: bool = False,
                 kv_int8: bool = False, use_graphs: bool | None = None,
                 console: Console | None = None, total_bytes: int | None = None):
        if exact and kv_int8:
            raise ValueError("exact mode keeps the KV cache in float32: no int8 KV")
        self._init_passes(config, exact, np.float32 if exact else
                          (np.int8 if kv_int8 else np.float16), use_graphs, cuda.stream())
        # the host lookup, for tables the device cannot read
        self.embedding = Embedding(tensors.token_embd)
        up = self._upload(tensors, console, total_bytes)
        self.weight_bytes = up.n_bytes + up.half_bytes
        self.console = console
        if console is not None:
            halves = f", f16 copies for prefill {up.half_bytes / 2**30:.2f} GiB" \
                if up.half_bytes else ""
            console.print(f"CUDA weights: {up.n_tensors} tensors, {up.n_bytes / 2**30:.2f} GiB"
                          f"{' (dequantized to F32: exact mode)' if exact else ''}{halves}")

    def _init_passes(self, config: ModelConfig, exact: bool, kv_dtype, use_graphs: bool | None,
                     stream) -> None:
        """What running passes needs besides the weights (the MTP head's passes share it)."""
        self.config, self.exact, self.kv_dtype, self.stream = config, exact, kv_dtype, stream
        self.use_graphs = (not IS_SIMULATOR) if use_graphs is None else use_graphs
        # SPARKINFER_BATCH_INVARIANT: the engine keeps every pass within the rows computed as
        # decodes (invariant_pass_tokens), whose attention takes a lone decode's splits
        self.fixed_splits = env.SPARKINFER_BATCH_INVARIANT.get()
        self.invariant_pass_tokens = DRAFT_PASS_TOKENS if self.fixed_splits else 0
        self._marks = [StreamMark() for _ in range(MAX_QUEUED_STEPS)]  # decode_greedy's passes
        self.times: StepTimes = StepTimes()
        self._passes: weakref.WeakKeyDictionary[CudaModelCache, CachePasses] = \
            weakref.WeakKeyDictionary()
        self.console = None

    def _upload(self, tensors: ModelTensors, console: Console | None,
                total_bytes: int | None) -> Uploader:
        """Every weight on the device, whole file tensors read from the file (Uploader.file)."""
        up = self._uploader()
        # exact mode uploads host arrays of dequantized rows: no staging to open
        reader = nullcontext() if self.exact else FileUploader(tensors.path, self.stream)
        with upload_progress(console) as progress, reader as f:
            up.progress, up.task = progress, progress.add_task("weights", total=total_bytes)
            up.file = f
            self.layers = [self._upload_layer(up, t, i) for i, t in enumerate(tensors.layers)]
            self.output_norm = up.vector(tensors.output_norm)
            self.output = up.linear(tensors.output)
            self.token_embd = self._upload_embedding(up, tensors.token_embd)
            self.stream.synchronize()
        return up

    def _uploader(self) -> Uploader:
        return Uploader(self.exact, stream=self.stream,
                        f16_copies=not self.exact and env.SPARKINFER_F16_PREFILL.get())

    def _upload_layer(self, up: Uploader, t: LayerTensors, i: int) -> CudaLayer:
        cfg = self.config
        mixer: CudaAttention | CudaGatedDeltaNet
        if isinstance(t.mixer, DeltaNetTensors):
            mixer = CudaGatedDeltaNet(up, t.mixer, cfg, i)
        else:
            mixer = CudaAttention(up, t.mixer, cfg, i)
        ffn = CudaMoE(up, t.ffn, cfg) if isinstance(t.ffn, MoETensors) else \
            CudaSwiGLU(up, t.ffn, "ffn")
        return CudaLayer(up.vector(t.attn_norm), mixer, up.vector(t.ffn_norm), ffn)

    def _upload_embedding(self, up: Uploader, table: QTensor):
        """The token table the device lookup reads: the output matrix when tied, else uploaded;
        None for a type embedding.embed_rows does not read (then the host looks rows up)."""
        if self.config.tied_embeddings:
            w = self.output.matrix
            return w if embedding.supports(w.ggml_type, w.k) else None
        if not embedding.supports(GGMLType.F32 if self.exact else table.ggml_type,
                                  table.shape[0]):
            return None
        return up.matrix(table)

    # ---- the Model interface -------------------------------------------------------------------
    def create_cache(self, num_blocks: int, block_size: int,
                     num_state_slots: int) -> CudaModelCache:
        cache = CudaModelCache(self.config, num_blocks, block_size, num_state_slots,
                               self.kv_dtype, self.stream)
        if self.console is not None:
            mem = self.memory_report(cache)
            self.console.print("CUDA memory: " + ", ".join(f"{k} {v / 2**30:.2f} GiB"
                                                           for k, v in mem.items()))
        return cache

    def forward(self, batch: SequenceBatch, cache: CudaModelCache) -> np.ndarray:
        """Logits (num_seqs, V) for each sequence's last new token, or (N, V) if all_logits."""
        p = self._pass(batch, cache)
        logits = self._host_logits(p)
        self._finish(p)
        return logits  # (n_logits, n_vocab)

    def forward_hidden(self, batch: SequenceBatch,
                       cache: CudaModelCache) -> tuple[np.ndarray, np.ndarray]:
        """forward's logits and the output norm's rows of every new token (N, n_embd), which
        the pass leaves in ws.x."""
        p = self._pass(batch, cache)
        logits = self._host_logits(p)
        hidden = self._host_hidden(p, len(batch.token_ids))
        self._finish(p)
        return logits, hidden

    def forward_greedy_hidden(self, batch: SequenceBatch,
                              cache: CudaModelCache) -> tuple[np.ndarray, np.ndarray]:
        p = self._pass(batch, cache, greedy=True)
        ids = self._host_ids(p)
        hidden = self._host_hidden(p, len(batch.token_ids))
        self._finish(p)
        return ids.copy(), hidden

    def _host_ids(self, p: QueuedPass) -> np.ndarray:
        """A greedy pass's ids: the pinned row they are copied into (read once the stream is
        there)."""
        picks = p.ws.sampling(p.logit_rows, self.output.n_rows)
        copy_to_host_async(picks.ids_host[0], picks.ids, self.stream)
        return picks.ids_host[0, :p.n_logits]

    def _host_hidden(self, p: QueuedPass, n_tokens: int) -> np.ndarray:
        rows = p.ws.x.f.reshape(p.ws.n_rows, -1)[:n_tokens]
        return rows.copy_to_host(stream=self.stream)

    def _host_logits(self, p: QueuedPass) -> np.ndarray:
        """A queued pass's real logit rows, copied to the host once the stream gets there."""
        logits = self._logits(p.ws, p.logit_rows).reshape(p.logit_rows, -1)[:p.n_logits]
        return logits.copy_to_host(stream=self.stream)

    def forward_greedy(self, batch: SequenceBatch, cache: CudaModelCache) -> np.ndarray:
        """The argmax token id (num_seqs,) int32 of each sequence's logits (ties → lowest id),
        picked on the device inside the pass (and its graph): only the ids come back, through a
        pinned buffer, not num_seqs × V floats."""
        return self.forward_sampled(batch, cache, None)

    def forward_sampled(self, batch: SequenceBatch, cache: CudaModelCache,
                        rows: SamplingRows | None) -> np.ndarray:
        """The token id (num_seqs,) int32 each sequence's logits give, picked on the device
        inside the pass as forward_greedy's argmax: by each sequence's DeviceDraw
        (kernels/cuda/sampling.py: the host Sampler's choice for the same u where
        sampling.supports_exactly; temperature 0 = argmax); None = argmax on all."""
        p = self._pass(batch, cache, greedy=True, sampling_rows=rows)
        ids = self._host_ids(p)
        self._finish(p)
        return ids.copy()  # (n_logits,)

    def decode_greedy(self, batch: SequenceBatch, cache: CudaModelCache,
                      n_steps: int) -> Iterator[np.ndarray]:
        """n_steps greedy decode passes of a decode batch, each pass's tokens the previous pass's
        argmax ids: the ids (num_seqs,) of each pass in turn, as forward_greedy would return them.
        With the device lookup every pass is queued now, the next one reading the previous one's
        ids on the device, so the host prepares pass i + 1 while the GPU runs pass i and reads
        pass i's ids as soon as it is done; without it the passes run one at a time. Read every
        pass's ids before the next call. The block tables must cover start + n_steps tokens."""
        _check_decode_steps(batch, cache, n_steps)
        if self.token_embd is None:
            return self._decode_greedy_one_by_one(batch, cache, n_steps)
        queued, previous_ids = [], None
        for step in range(n_steps):
            p = self._pass(batch, cache, greedy=True, step=step, device_tokens=previous_ids)
            picks = p.ws.sampling(p.logit_rows, self.output.n_rows)
            copy_to_host_async(picks.ids_host[step], picks.ids, self.stream)
            previous_ids = picks.ids
            self._marks[step].record(self.stream)
            queued.append(p)
            # the next pass's tokens are copied in on the device; -1 (a zero embedding) until then
            batch = batch.next_decode_step(np.full(batch.num_seqs, -1, np.int32))
        return self._queued_ids(queued)

    def _decode_greedy_one_by_one(self, batch: SequenceBatch, cache: CudaModelCache,
                                  n_steps: int) -> Iterator[np.ndarray]:
        for _ in range(n_steps):
            ids = self.forward_greedy(batch, cache)
            yield ids
            batch = batch.next_decode_step(ids)

    def decode_drawn(self, batch: SequenceBatch, cache: CudaModelCache, n_steps: int,
                     draws: Callable[[int], SamplingRows]) -> Iterator[np.ndarray]:
        """n_steps decode passes as decode_greedy's, each sequence's token drawn by draws(step)
        (forward_sampled's rows): the draws of a step are asked for only after the previous
        step's ids were yielded, since a grammar's mask depends on them. Every pass's forward is
        queued before the previous pass's ids reach the host, and its draw launched once its
        rows come, so the host's work for a step's rows (advancing the grammars, computing
        their masks) runs while the GPU computes that step's logits."""
        _check_decode_steps(batch, cache, n_steps)
        if self.token_embd is None:
            return self._decode_drawn_one_by_one(batch, cache, n_steps, draws)
        return self._drawn_ids(batch, cache, n_steps, draws)

    def _decode_drawn_one_by_one(self, batch: SequenceBatch, cache: CudaModelCache,
                                 n_steps: int, draws: Callable[[int], SamplingRows]
                                 ) -> Iterator[np.ndarray]:
        for step in range(n_steps):
            ids = self.forward_sampled(batch, cache, draws(step))
            yield ids
            batch = batch.next_decode_step(ids)

    def _drawn_ids(self, batch: SequenceBatch, cache: CudaModelCache, n_steps: int,
                   draws: Callable[[int], SamplingRows]) -> Iterator[np.ndarray]:
        """On the stream: forward 0, draw 0, forward 1, (host: ids 0 back, rows 1) draw 1,
        forward 2, … A draw's staging buffers are refilled only after the draw before it ran."""
        passes = [self._pass(batch, cache)]
        self._queue_draw(passes[0], draws(0), 0)
        for step in range(n_steps):
            p = passes[step]
            if step + 1 < n_steps:  # fed this step's ids on the device; -1 until they are there
                batch = batch.next_decode_step(np.full(batch.num_seqs, -1, np.int32))
                ids = p.ws.sampling(p.logit_rows, self.output.n_rows).ids
                passes.append(self._pass(batch, cache, step=step + 1, device_tokens=ids))
            self._marks[step].wait()
            self.times.add(p.kind, p.t_queued - p.t0, time.perf_counter() - p.t0)
            yield p.ws.sampling(p.logit_rows, self.output.n_rows).ids_host[step, :p.n_logits].copy()
            if step + 1 < n_steps:
                self._queue_draw(passes[step + 1], draws(step + 1), step + 1)

    def _queue_draw(self, p: QueuedPass, rows: SamplingRows, step: int) -> None:
        """After pass p's logits: draw its ids by rows, copy them to the host row of step."""
        picks = p.ws.sampling(p.logit_rows, self.output.n_rows)
        picks.stage(rows, self.stream)
        self._draw(p.ws, p.logit_rows, self.stream)
        copy_to_host_async(picks.ids_host[step], picks.ids, self.stream)
        self._marks[step].record(self.stream)

    def _queued_ids(self, queued: list[QueuedPass]) -> Iterator[np.ndarray]:
        for step, p in enumerate(queued):
            self._marks[step].wait()
            self.times.add(p.kind, p.t_queued - p.t0, time.perf_counter() - p.t0)
            picks = p.ws.sampling(p.logit_rows, self.output.n_rows)
            yield picks.ids_host[step, :p.n_logits].copy()  # (num_seqs,)

    # ---- internals -----------------------------------------------------------------------------
    def _pass(self, batch: SequenceBatch, cache: CudaModelCache, greedy: bool = False,
              step: int = 0, device_tokens=None, sampling_rows=None,
              rows_in: np.ndarray | None = None) -> QueuedPass:
        """Queue a forward pass (graph replay or eager launches) up to the logits on the device,
        and their token ids (ws.sampling: argmax, or drawn by sampling_rows) when greedy. step: the
        staging row of its inputs (a queued decode pass's own); device_tokens: a device array
        whose first N ids replace the batch's token ids (the previous decode pass's argmax);
        rows_in: (N, n_embd) floats a row the pass reads beside its tokens (ws.rows_in: the MTP
        head's hidden states)."""
        t0 = time.perf_counter()
        if len(batch.token_ids) > MAX_PASS_TOKENS:
            raise ValueError(f"a CUDA forward pass takes at most {MAX_PASS_TOKENS} tokens, got "
                             f"{len(batch.token_ids)} (prefill in chunks)")
        if self.config.is_hybrid:  # a sequence at position 0 has no history, whatever its slot held
            for start, slot in zip(batch.start_positions, batch.state_slots or [0]):
                if start == 0:
                    cache.reset_state(slot)
        passes = self._passes.get(cache) or self._passes.setdefault(cache, CachePasses())
        ws = self._workspace(passes, cache, row_bucket(len(batch.token_ids)))
        on_host = self.token_embd is None
        ws.fill(batch, self.embedding(batch.token_ids) if on_host else None, step)
        ws.multi_token = max(batch.num_new_tokens) > 1
        ws.upload(self.stream, step)
        if rows_in is not None:
            ws.stage_rows_in(rows_in, self.stream)
        if device_tokens is not None:
            n = len(batch.token_ids)
            copy_device_async(ws.token_ids[:n], device_tokens[:n], self.stream)
        n_logits = len(batch.logit_rows())
        key = graph_key(len(batch.token_ids), batch.num_seqs, n_logits, greedy,
                        self.fixed_splits)
        _, _, logit_rows, ws.split_rows, _ = key
        if greedy:
            ws.sampling(logit_rows, self.output.n_rows).stage(sampling_rows, self.stream)
        replay = self.use_graphs and key in passes.graphs
        if replay:
            passes.graphs[key].replay()
        else:  # the first pass of its kind: eager (compiles, creates buffers), then captured
            self._run(ws, cache, logit_rows, self.stream, greedy)
            if self.use_graphs:
                passes.graphs[key] = graphs.capture(
                    lambda s: self._run(ws, cache, logit_rows, s, greedy), self.stream)
        kind = "decode" if replay and not ws.multi_token else "other"
        return QueuedPass(ws, logit_rows, n_logits, t0, time.perf_counter(), kind)

    def _finish(self, p: QueuedPass) -> None:
        self.stream.synchronize()
        self.times.add(p.kind, p.t_queued - p.t0, time.perf_counter() - p.t0)

    def _workspace(self, passes: CachePasses, cache: CudaModelCache, n_rows: int) -> Workspace:
        if n_rows not in passes.workspaces:
            heads = self.config.n_head if self.config.attention_layers else 0
            chunked = any(isinstance(layer.mixer, CudaGatedDeltaNet) and layer.mixer.chunked
                          for layer in self.layers)
            passes.workspaces[n_rows] = Workspace(n_rows, cache.shape, self.config.n_embd,
                                                  not self.exact, heads, self.config.head_dim,
                                                  lists_chunks=chunked)
        return passes.workspaces[n_rows]

    def _run(self, ws: Workspace, cache: CudaModelCache, logit_rows: int, s,
             greedy: bool = False) -> None:
        """Every launch of one pass, on stream (or graph builder) s; greedy: and the argmax."""
        eps = self.config.rms_eps
        self._first_input(ws, s)
        for i, layer in enumerate(self.layers):
            if i > 0:  # the previous FFN's output joins the residual inside this pre-norm
                self.layers[i - 1].ffn.add_norm(ws, layer.attn_norm, eps, s, ws.x.q)
            layer.mixer(ws, cache, s)
            norm.add_rms_norm(ws.delta, ws.h, layer.ffn_norm, ws.x.f, eps, stream=s, act=ws.x.q)
            layer.ffn(ws, s)
        self.layers[-1].ffn.add_norm(ws, self.output_norm, eps, s, None)
        final = self._final(ws, logit_rows)
        gather_rows(ws.x.f.reshape(ws.n_rows, -1), ws.logit_rows[:logit_rows],
                    final.f.reshape(logit_rows, -1), stream=s)
        if self.output.reads_q8(ws, logit_rows):
            final.quantize(s)
        logits = self._logits(ws, logit_rows)
        self.output(ws, final, logits, s)
        if greedy:
            self._draw(ws, logit_rows, s)

    def _first_input(self, ws: Workspace, s) -> None:
        """ws.h = the pass's token embeddings (unless the host looked them up), ws.x = the first
        layer's normed input."""
        if self.token_embd is not None:
            embedding.embed_rows(self.token_embd, ws.token_ids, ws.h.reshape(ws.n_rows, -1),
                                 stream=s)
        norm.rms_norm(ws.h, self.layers[0].attn_norm, ws.x.f, self.config.rms_eps, stream=s,
                      act=ws.x.q)

    def _draw(self, ws: Workspace, logit_rows: int, s) -> None:
        """The ids of a pass's logits, by the draws staged in ws.sampling."""
        g = ws.sampling(logit_rows, self.output.n_rows)
        sampling.sample(self._logits(ws, logit_rows).reshape(logit_rows, -1), *g.params, g.ids,
                        g.workspace, stream=s, allowed=g.allowed)

    def _final(self, ws: Workspace, logit_rows: int):
        """The output norm's logit rows, the output matrix's input (an Act)."""
        cols = min(logit_rows, ws.cols)
        return ws.act("final", self.config.n_embd, logit_rows // cols, cols)

    def _logits(self, ws: Workspace, logit_rows: int):
        cols = min(logit_rows, ws.cols)
        return ws.buf("logits", logit_rows // cols, cols, self.output.n_rows)

    def memory_report(self, cache: CudaModelCache) -> dict[str, int]:
        passes = self._passes.get(cache)
        workspace = sum(ws.memory_bytes() for ws in passes.workspaces.values()) if passes else 0
        return {"weights": self.weight_bytes, **cache.memory_bytes(), "workspace": workspace}

    def prepare(self, cache: CudaModelCache, max_seqs: int, max_pass_tokens: int) -> None:
        """Compile and capture now, before serving, every pass the engine can run with at most
        max_seqs sequences and max_pass_tokens tokens (graph_shapes), with logits back and with
        ids back. Uses the pool's blocks as scratch: call it before any request holds KV."""
        pool_tokens = cache.num_blocks * cache.block_size  # no pass computes more tokens
        limit = min(max_pass_tokens, MAX_PASS_TOKENS, pool_tokens)
        for n_tokens, n_seqs, n_logits in graph_shapes(max_seqs, limit, self.fixed_splits):
            # a bucket the pool cannot fill runs with as many tokens as it holds
            n_tokens = n_tokens if n_tokens == n_seqs else min(n_tokens, pool_tokens)
            self._capture(self._dummy_batch(cache, n_tokens, n_seqs, n_logits), cache)
        # the entry copies a request may ask for (prefix-cache blocks and state snapshots, a
        # draft check's state copy) compile now too, from the scratch entries into free ones
        cache.copy_blocks([cache.scratch_block], [0])
        if self.config.is_hybrid:
            cache.copy_state(cache.scratch_slot, 0)

    def _capture(self, batch: SequenceBatch, cache: CudaModelCache) -> None:
        self.forward(batch, cache)
        self.forward_greedy(batch, cache)

    def _dummy_batch(self, cache: CudaModelCache, n_tokens: int, n_seqs: int,
                     n_logits: int) -> SequenceBatch:
        """n_seqs sequences from position 0: the first brings n_tokens − n_seqs + 1 tokens (in the
        pool's first blocks) and the logit rows beyond one a sequence (up to its tokens), every
        other one token (in the scratch block)."""
        first = n_tokens - n_seqs + 1
        logit_counts = [min(first, n_logits - n_seqs + 1)] + [1] * (n_seqs - 1)
        tables = [np.arange(-(-first // cache.block_size), dtype=np.int32)] + \
            [np.array([cache.scratch_block], np.int32)] * (n_seqs - 1)
        token_ids = np.arange(n_tokens, dtype=np.int32) % self.config.n_vocab  # (n_tokens,)
        slots = [cache.scratch_slot] * n_seqs if self.config.is_hybrid else []
        return SequenceBatch(token_ids, [0] * n_seqs, [first] + [1] * (n_seqs - 1), tables,
                             slots, logit_counts=logit_counts)


def _check_decode_steps(batch: SequenceBatch, cache: CudaModelCache, n_steps: int) -> None:
    """ValueError unless batch is one new token a sequence, n_steps within the queue and every
    block table covers the tokens the steps add."""
    if not batch.is_decode or batch.all_logits or not 1 <= n_steps <= MAX_QUEUED_STEPS:
        raise ValueError(f"queued decode passes take a batch of one new token a sequence and 1 "
                         f"to {MAX_QUEUED_STEPS} steps, got {n_steps}")
    for start, table in zip(batch.start_positions, batch.block_tables):
        if len(table) * cache.block_size < start + n_steps:
            raise ValueError(f"a block table of {len(table)} blocks does not cover "
                             f"{start + n_steps} tokens")


def graph_key(n_tokens: int, n_seqs: int, n_logits: int, greedy: bool,
              fixed_splits: bool = False) -> GraphKey:
    """What a pass's captured graph depends on: (row bucket, several tokens a sequence, logit
    rows, the rows its attention's splits are counted for, ids picked too). Up to
    DRAFT_PASS_TOKENS rows (Workspace.rows_as_decodes) those are the row bucket of its
    sequences, so that a sequence's several rows (drafts to check) take the splits of the decode
    pass they stand for; fixed_splits (batch-invariant mode): 1, a decode alone's, whatever
    shares the pass."""
    n_rows, multi_token = row_bucket(n_tokens), n_tokens > n_seqs
    split_rows = n_rows if n_rows > DRAFT_PASS_TOKENS else 1 if fixed_splits else \
        row_bucket(n_seqs)
    return n_rows, multi_token, logit_bucket(n_logits, n_rows, multi_token), split_rows, greedy


def graph_shapes(max_seqs: int, max_pass_tokens: int,
                 fixed_splits: bool = False) -> list[tuple[int, int, int]]:
    """(tokens, sequences, logit rows) of one pass of each graph key a pass of at most max_seqs
    sequences and max_pass_tokens tokens can have: decode passes (one token a sequence) of each
    row bucket; passes with several tokens a sequence of each row bucket and logit bucket, and
    up to DRAFT_PASS_TOKENS tokens of each bucket of sequences too, with up to a logit row a
    token (a decode's drafts are checked there)."""
    decode_rows = _pow2_range(1, row_bucket(min(max_seqs, MAX_GRAPH_ROWS, max_pass_tokens)))
    shapes = {graph_key(n, n, n, False, fixed_splits): (n, n, n)
              for n in (min(rows, max_seqs) for rows in decode_rows)}
    for n_tokens in range(2, min(DRAFT_PASS_TOKENS, max_pass_tokens) + 1):
        for n_seqs in range(1, min(n_tokens - 1, max_seqs) + 1):
            for n_logits in range(n_seqs, n_tokens + 1):
                shapes.setdefault(graph_key(n_tokens, n_seqs, n_logits, False, fixed_splits),
                                  (n_tokens, n_seqs, n_logits))
    for n_rows in _pow2_range(2 * DRAFT_PASS_TOKENS, row_bucket(max_pass_tokens)):
        widest = logit_bucket(max_seqs, n_rows, True)
        for n_logits in _pow2_range(min(MIN_PROMPT_LOGIT_ROWS, widest), widest):
            # the fewest sequences whose logit rows fill the bucket n_logits (fewer than n_rows,
            # so that one of them brings two tokens)
            n_seqs = 1 if n_logits <= MIN_PROMPT_LOGIT_ROWS else n_logits // 2 + 1
            shapes[graph_key(n_rows, n_seqs, n_seqs, False, fixed_splits)] = \
                (n_rows, n_seqs, n_seqs)
    return list(shapes.values())


def logit_bucket(n_logits: int, n_rows: int, multi_token: bool) -> int:
    """Logit rows a pass of n_rows rows with n_logits of them computes. A pass with prompt
    tokens rounds up to at least MIN_PROMPT_LOGIT_ROWS (within its rows): the output GEMV reads
    its matrix once for up to that many rows, so the smaller buckets cost as much and would only
    add graphs to capture."""
    n = row_bucket(n_logits)
    return min(max(n, MIN_PROMPT_LOGIT_ROWS), n_rows) if multi_token else n


def _pow2_range(lo: int, hi: int) -> list[int]:
    """The powers of two from lo to hi, both included (lo a power of two)."""
    return [1 << i for i in range(lo.bit_length() - 1, hi.bit_length())] if lo <= hi else []


def load_cuda_model(gguf: GGUFFile, config: ModelConfig, *, exact: bool = False,
                    kv_int8: bool = False, console: Console | None = None) -> CudaModel:
    """The architecture's tensors, uploaded to the GPU straight from the file."""
    total = None if exact else sum(info.n_bytes for info in gguf.tensors.values())
    return CudaModel(resolve_tensors(gguf, config), config, exact=exact, kv_int8=kv_int8,
                     console=console, total_bytes=total)
