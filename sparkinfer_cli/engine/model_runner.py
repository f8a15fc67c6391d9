"""ModelRunner: SchedulerOutput → one model.forward → logits of the sequences that sample this step.

It makes no policy decisions: it applies the cache operations the scheduler asked for, builds the
SequenceBatch and runs the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from sparkinfer_cli.engine.kv_cache import CacheOps
from sparkinfer_cli.engine.scheduler import ScheduledSequence, SchedulerOutput
from sparkinfer_cli.model.backend import ModelBackend, ModelCache
from sparkinfer_cli.model.batch import SamplingRows, SequenceBatch


class ModelRunner:
    def __init__(self, model: ModelBackend, cache: ModelCache,
                 block_mirrors: Sequence[ModelCache] = ()):
        """block_mirrors: caches laid out like cache (a drafter's) that take its block copies."""
        self.model, self.cache = model, cache
        self.block_mirrors = block_mirrors
        self.is_hybrid = model.config.is_hybrid
        self.last_forward_s = 0.0  # wall time of the latest run()'s model.forward
        self.clock: Callable[[], float] = time.perf_counter  # what times it (tests: a model's)

    def run(self, output: SchedulerOutput) -> dict[str, np.ndarray]:
        """request id → (n_vocab,) logits, for each sequence whose piece ends its known tokens."""
        return self._run(output, self.model.forward)  # rows of (num_seqs, n_vocab)

    def run_hidden(self, output: SchedulerOutput, picks: bool = False
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """run()'s rows (picks: run_device_picks' argmax ids instead), and request id → the
        normed hidden state of each token the step computes for it (ModelBackend.forward_hidden:
        what an MTP head reads)."""
        hidden = {}
        forward_hidden = self.model.forward_greedy_hidden if picks else self.model.forward_hidden

        def forward(batch: SequenceBatch, cache: ModelCache) -> np.ndarray:
            logits, states = forward_hidden(batch, cache)  # states: (N, n_embd)
            offsets = batch.token_offsets()
            for i, seq in enumerate(output.sequences):
                hidden[seq.request_id] = states[offsets[i]:offsets[i + 1]]
            return logits

        return self._run(output, forward), hidden

    @property
    def can_pick_greedy(self) -> bool:
        """The model picks argmax tokens on its device (ModelBackend.forward_greedy)."""
        return self.model.picks_on_device

    @property
    def max_sample_top_k(self) -> int:
        """The widest top-k the model samples on its device; 0: argmax ids only, or none."""
        return self.model.max_sample_top_k

    def run_device_picks(self, output: SchedulerOutput,
                         rows: SamplingRows | None = None) -> dict[str, np.ndarray]:
        """request id → the token (a 0-d array) of the same sequences as run(), picked by the
        model: the argmax, or drawn by rows (one per sequence that samples: Sampler.device_draw)
        where given. Only the ids leave the device, not num_seqs × n_vocab floats."""
        if rows is None:
            return self._run(output, self.model.forward_greedy)
        # the sequences that sample take their draws; the others the argmax (their ids unused)
        sampling = [i for i, s in enumerate(output.sequences) if s.needs_logits]
        return self._run(output, lambda batch, cache: self.model.forward_sampled(
            batch, cache, rows.spread(len(output.sequences), sampling)))

    @property
    def max_decode_steps(self) -> int:
        """Decode passes the model queues at once (ModelBackend.decode_greedy)."""
        return self.model.max_queued_steps

    def run_decode_steps(self, output: SchedulerOutput, n_steps: int,
                         draws: Callable[[int], SamplingRows] | None = None
                         ) -> Iterator[np.ndarray]:
        """The ids (num_seqs,) of n_steps decode passes over output's sequences, in turn, each
        pass fed the previous pass's ids on the model's device: the argmax, or drawn by
        draws(step), called once the previous pass's ids were read. Read them all."""
        self.apply_cache_ops(output.cache_ops)
        batch = self.prepare_batch(output.sequences)
        started = self.clock()
        passes = self.model.decode_greedy(batch, self.cache, n_steps) if draws is None else \
            self.model.decode_drawn(batch, self.cache, n_steps, draws)
        for ids in passes:
            self.last_forward_s += self.clock() - started
            yield ids
            started = self.clock()

    def _run(self, output: SchedulerOutput,
             forward: Callable[[SequenceBatch, ModelCache], np.ndarray]) -> dict[str, np.ndarray]:
        self.apply_cache_ops(output.cache_ops)
        if not output.sequences:
            return {}
        batch = self.prepare_batch(output.sequences)
        started = self.clock()
        result = forward(batch, self.cache)  # (Σ logit rows, ...)
        self.last_forward_s = self.clock() - started
        rows, cursor = {}, 0
        for seq in output.sequences:  # NOTE: a sequence with drafts gets (1 + drafts, ...) rows
            n = 1 + seq.num_drafts
            if seq.needs_logits:
                rows[seq.request_id] = result[cursor:cursor + n] if n > 1 else result[cursor]
            cursor += n
        return rows

    def run_all_logits(self, output: SchedulerOutput) -> np.ndarray:
        """(N, n_vocab) logits of every token the step computes (a prompt whose logprobs are
        asked for)."""
        self.apply_cache_ops(output.cache_ops)
        batch = self.prepare_batch(output.sequences)
        batch.all_logits = True
        started = self.clock()
        logits = self.model.forward(batch, self.cache)
        self.last_forward_s = self.clock() - started
        return logits

    def apply_cache_ops(self, ops: CacheOps) -> None:
        if ops.block_copies:
            src, dst = zip(*ops.block_copies)
            for cache in (self.cache, *self.block_mirrors):
                cache.copy_blocks(list(src), list(dst))
        for src_slot, dst_slot in ops.state_copies:
            self.cache.copy_state(src_slot, dst_slot)
        for slot in ops.state_resets:
            self.cache.reset_state(slot)

    def prepare_batch(self, sequences: list[ScheduledSequence]) -> SequenceBatch:
        token_ids = np.fromiter((t for s in sequences for t in s.token_ids), dtype=np.int32)  # (N,)
        return SequenceBatch(
            token_ids=token_ids,
            start_positions=[s.start_position for s in sequences],
            num_new_tokens=[len(s.token_ids) for s in sequences],
            block_tables=[np.asarray(s.block_ids, dtype=np.int32) for s in sequences],
            state_slots=[s.state_slot for s in sequences] if self.is_hybrid else [],
            logit_counts=[1 + s.num_drafts for s in sequences]
            if any(s.num_drafts for s in sequences) else [],
            draft_state_slots=[s.draft_state_slots for s in sequences]
            if any(s.draft_state_slots for s in sequences) else [],
        )

    def prefill(self, token_ids: Sequence[int], block_ids: Sequence[int], state_slot: int,
                chunk_tokens: int = 0) -> None:
        """Computes KV (and recurrent state) of tokens outside the scheduler: the shared prefix."""
        step = chunk_tokens or len(token_ids)
        table = np.asarray(block_ids, dtype=np.int32)  # (num_blocks,)
        for start in range(0, len(token_ids), step):
            piece = np.asarray(token_ids[start:start + step], dtype=np.int32)  # (piece,)
            self.model.forward(SequenceBatch.single(piece, start, table, max(state_slot, 0)),
                               self.cache)
