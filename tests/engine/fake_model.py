"""A deterministic stand-in for Model/ModelCache, and a tiny real Tokenizer, for engine tests.

FakeCache stores token ids where a real cache stores K/V (and a running hash where a hybrid model
keeps its recurrent state). FakeModel's next token is a hash of everything the sequence's cache
holds, read back through its block table: a KV mix-up between sequences, a missing prefix copy or
an un-reset state slot changes the output. `expected_greedy` computes the same function straight
from the token list, without any cache: the oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sparkinfer_cli.engine.request import RequestStatus
from sparkinfer_cli.model.backend import ModelBackend
from sparkinfer_cli.model.batch import SamplingRows, SequenceBatch
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer, TokenType, byte_level_encode

# 26 letters, a space-letter token per letter, 2 halves of "é", then control tokens.
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TOKENS = [*LETTERS, *(byte_level_encode(b" " + c.encode()) for c in LETTERS),
          *(byte_level_encode(bytes([b])) for b in "é".encode()), "<|endoftext|>", "<|im_end|>"]
EOS_ID, IM_END_ID = len(TOKENS) - 2, len(TOKENS) - 1
N_VOCAB = len(TOKENS)
MODULUS = (1 << 61) - 1


def make_tokenizer() -> Tokenizer:
    types = [TokenType.NORMAL] * (N_VOCAB - 2) + [TokenType.CONTROL] * 2
    return Tokenizer(TOKENS, types, [], "qwen2", eos_id=EOS_ID)


def extend_hash(h: int, token_ids: Sequence[int]) -> int:
    for t in token_ids:
        h = (h * 1_000_003 + int(t) + 1) % MODULUS
    return h


def next_token(token_ids: Sequence[int], avoid: Sequence[int] = (EOS_ID, IM_END_ID)) -> int:
    """The fake model's greedy choice after token_ids (never an end-of-generation token)."""
    t = extend_hash(0, token_ids) % N_VOCAB
    while t in avoid:
        t = (t + 1) % N_VOCAB
    return t


def expected_greedy(prompt: Sequence[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


@dataclass
class FakeConfig:
    n_vocab: int = N_VOCAB
    context_length: int = 1 << 20
    is_hybrid: bool = False

    def recurrent_state_bytes(self) -> int:
        return 8  # FakeCache keeps one int a slot


class FakeCache:
    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_state_slots = num_state_slots
        self.tokens = np.full((num_blocks, block_size), -1, dtype=np.int64)  # (block, slot)
        self.state = [7] * num_state_slots  # garbage until reset_state: a missing reset shows

    def write(self, block_table: np.ndarray, start: int, token_ids: np.ndarray) -> None:
        pos = np.arange(start, start + len(token_ids))
        self.tokens[block_table[pos // self.block_size], pos % self.block_size] = token_ids

    def read(self, block_table: np.ndarray, length: int) -> list[int]:
        pos = np.arange(length)
        values = self.tokens[block_table[pos // self.block_size], pos % self.block_size]
        if (values < 0).any():
            raise RuntimeError("read of a cache position that was never written")
        return values.tolist()

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.tokens[list(dst)] = self.tokens[list(src)]

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        self.state[dst_slot] = self.state[src_slot]

    def reset_state(self, slot: int) -> None:
        self.state[slot] = 0


class FakeClock:
    """The time a FakeModel's passes took: each forward adds what its rows cost, so what the
    engine measures (ModelRunner.clock) is the same on every run."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeModel(ModelBackend):
    """Greedy-deterministic model; counts computed tokens; can fail or call a hook on demand."""

    scores_drafts = True  # honours batch.logit_counts
    snapshots_draft_states = True  # writes batch.draft_state_slots (False: the engine restores)

    @staticmethod
    def pass_seconds(num_rows: int) -> float:
        """What a pass of num_rows tokens costs on FakeClock: a GPU decode's shape, where a few
        more rows cost little, so drafts pay wherever they are kept."""
        return 1e-3 * (1 + num_rows / 64)

    @staticmethod
    def pick(seen: Sequence[int]) -> int:
        """The greedy next token after seen (subclasses: another deterministic rule)."""
        return next_token(seen)

    def __init__(self, hybrid: bool = False):
        self.config = FakeConfig(is_hybrid=hybrid)
        self.num_forward_tokens = 0
        self.batch_sizes: list[int] = []
        self.fail_on_token: int | None = None  # forward raises when this token id is fed
        self.before_forward: Callable[[SequenceBatch], None] | None = None
        self.clock: FakeClock | None = FakeClock()  # None: the engine times it on its own clock

    def create_cache(self, num_blocks: int, block_size: int, num_state_slots: int) -> FakeCache:
        return FakeCache(num_blocks, block_size, num_state_slots)

    def forward(self, batch: SequenceBatch, cache: FakeCache) -> np.ndarray:
        if self.before_forward is not None:
            self.before_forward(batch)
        if self.fail_on_token is not None and self.fail_on_token in batch.token_ids:
            raise RuntimeError("injected model failure")
        self.num_forward_tokens += len(batch.token_ids)
        if self.clock is not None:
            self.clock.now += self.pass_seconds(len(batch.token_ids))
        self.batch_sizes.append(batch.num_seqs)
        offsets = batch.token_offsets()
        rows = [self._sequence_logits(batch, cache, i, batch.token_ids[offsets[i]:offsets[i + 1]])
                for i in range(batch.num_seqs)]
        return np.concatenate(rows)  # (num_seqs, n_vocab), or (N, n_vocab) for all_logits

    def _sequence_logits(self, batch: SequenceBatch, cache: FakeCache, i: int,
                         new_ids: np.ndarray) -> np.ndarray:
        start, table = batch.start_positions[i], batch.block_tables[i]
        cache.write(table, start, new_ids)
        seen = cache.read(table, start + len(new_ids))
        if self.config.is_hybrid:  # the state must hold exactly the hash of the KV-visible tokens
            slot = batch.state_slots[i]
            before = cache.state[slot]
            cache.state[slot] = extend_hash(before, new_ids)
            if cache.state[slot] != extend_hash(0, seen):
                raise RuntimeError("recurrent state does not match the sequence")
            drafts = batch.draft_state_slots[i] if batch.draft_state_slots else ()
            for j, draft_slot in enumerate(drafts):  # the state after each checked row
                cache.state[draft_slot] = extend_hash(before,
                                                      new_ids[:len(new_ids) - len(drafts) + j])
        count = batch.logit_counts[i] if batch.logit_counts else 1
        ends = range(start + 1 if batch.all_logits else len(seen) - count + 1, len(seen) + 1)
        logits = np.zeros((len(ends), N_VOCAB), dtype=np.float32)  # (rows, n_vocab)
        for row, end in enumerate(ends):  # the row after seen[:end] favours its greedy next token
            logits[row, self.pick(seen[:end])] = 1.0
        return logits


class FakeDeviceModel(FakeModel):
    """FakeModel with CudaModel's on-device calls: forward_greedy; forward_sampled, which draws
    by the host Sampler's own truncation and draw (engine/truncation.py) with the given u; and
    decode_greedy, which runs every pass when called (as the GPU queues them), each fed the
    previous pass's ids; decode_drawn, its sampled twin."""

    max_queued_steps = 8
    max_sample_top_k = 64
    picks_on_device = True

    def __init__(self, hybrid: bool = False):
        super().__init__(hybrid)
        self.decode_steps: list[int] = []  # n_steps of each decode_greedy / decode_drawn call
        self.sampled_rows: list[SamplingRows] = []  # the rows of each forward_sampled call

    def forward_greedy(self, batch: SequenceBatch, cache: FakeCache) -> np.ndarray:
        return self.forward(batch, cache).argmax(axis=1).astype(np.int32)  # (num_seqs,)

    def forward_sampled(self, batch: SequenceBatch, cache: FakeCache,
                        rows: SamplingRows) -> np.ndarray:
        self.sampled_rows.append(rows)
        logits = self.forward(batch, cache)  # (num_seqs, n_vocab)
        if rows.allowed is not None:  # the grammar masks' refused tokens out
            allowed = np.unpackbits(rows.allowed.view(np.uint8), axis=1, bitorder="little")
            logits = np.where(allowed[:, :logits.shape[1]].astype(bool), logits, -np.inf)
        return np.array([_pick(row, *params) for row, params in zip(logits, rows)], np.int32)

    def decode_greedy(self, batch: SequenceBatch, cache: FakeCache, n_steps: int):
        assert 1 <= n_steps <= self.max_queued_steps and batch.is_decode
        self.decode_steps.append(n_steps)
        passes = []
        for _ in range(n_steps):
            passes.append(self.forward_greedy(batch, cache))
            batch = batch.next_decode_step(passes[-1])
        return iter(passes)

    def decode_drawn(self, batch: SequenceBatch, cache: FakeCache, n_steps: int,
                     draws: Callable[[int], SamplingRows]):
        """As CudaModel's: a pass's draws are asked for only after the pass before it was read."""
        assert 1 <= n_steps <= self.max_queued_steps and batch.is_decode
        self.decode_steps.append(n_steps)
        for step in range(n_steps):
            ids = self.forward_sampled(batch, cache, draws(step))
            yield ids
            batch = batch.next_decode_step(ids)


def eos_first(model_class: type[FakeModel]) -> FakeModel:
    """A model_class whose every row has EOS as its argmax and the fake model's own pick second."""
    class EosFirst(model_class):
        def forward(self, batch: SequenceBatch, cache: FakeCache) -> np.ndarray:
            logits = super().forward(batch, cache)  # (num_seqs, n_vocab)
            logits[:, EOS_ID] = 2.0
            return logits

    return EosFirst()


def _pick(logits: np.ndarray, temperature: float, top_k: float, top_p: float, min_p: float,
          u: float) -> int:
    from sparkinfer_cli.engine.truncation import choose, thread_workspace

    if temperature <= 0:
        return int(np.argmax(logits))
    return choose(logits, temperature, int(top_k), top_p, min_p, u, thread_workspace(len(logits)))


@dataclass
class _Sample:
    token_id: int
    logprob: None = None


class SchedulerHarness:
    """Drives Scheduler without a model, checking the step invariants the runner relies on."""

    def __init__(self, is_hybrid: bool = False, max_step_tokens: int = 0, **config_kwargs):
        from sparkinfer_cli.engine.config import EngineConfig
        from sparkinfer_cli.engine.kv_cache import KVCacheManager
        from sparkinfer_cli.engine.policy import create_policy
        from sparkinfer_cli.engine.scheduler import Scheduler

        self.config = EngineConfig(**config_kwargs)
        self.kv = KVCacheManager.from_config(self.config, is_hybrid)
        if self.kv.prefix is not None:
            self.kv.pin_prefix()  # NOTE: bookkeeping only: no model computes its KV here
        self.scheduler = Scheduler(self.config, self.kv, create_policy(self.config),
                                   max_step_tokens)
        self.initial_free_blocks = self.kv.num_free_blocks
        self.max_step_tokens = max_step_tokens
        self.finished: dict[str, object] = {}
        self._arrivals = 0

    def add(self, prompt: Sequence[int], max_tokens: int, priority: int = 0):
        from sparkinfer_cli.engine.request import Request
        from sparkinfer_cli.engine.sampling_params import SamplingParams

        request = Request(f"r{self._arrivals}", list(prompt), SamplingParams(max_tokens=max_tokens),
                          priority=priority, arrival_seq=self._arrivals)
        self._arrivals += 1
        self.scheduler.add(request)
        return request

    def step(self):
        queue = sorted(self.scheduler.waiting, key=self.scheduler.policy.sort_key)
        output = self.scheduler.schedule()
        self.check(output)
        admitted = [r for r in queue if r.status is not RequestStatus.WAITING]
        assert admitted == queue[:len(admitted)], "a request was admitted out of policy order"
        self.scheduler.update_from_output(output)
        for seq in output.sequences:
            request = self.scheduler.requests[seq.request_id]
            if seq.needs_logits:
                reason = request.append_sample(_Sample(next_token(request.token_ids)))
                if reason:
                    self.scheduler.finish(request, reason)
                    self.finished[request.request_id] = request
        return output

    def run_to_completion(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.scheduler.has_unfinished:
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps

    def check(self, output) -> None:
        sched, bs = self.scheduler, self.config.block_size
        requests = [sched.requests[s.request_id] for s in output.sequences]
        is_prefill = [r.is_prefilling for r in requests]
        prefill_tokens = [len(s.token_ids) for s, p in zip(output.sequences, is_prefill) if p]
        assert len(prefill_tokens) <= sched.policy.max_prefills_per_step, "too many prefills"
        if self.max_step_tokens:
            assert output.num_tokens <= self.max_step_tokens, "the step exceeds the model's pass"
        if sched.policy.step_tokens and prefill_tokens:
            assert output.num_tokens <= sched.policy.step_tokens, "the step exceeds its budget"
        assert is_prefill == sorted(is_prefill), "a prefill was packed before a decode"
        assert len(is_prefill) - sum(is_prefill) <= self.config.max_batch_tokens
        assert len(sched.running) <= self.config.max_num_seqs
        for seq, request in zip(output.sequences, requests):
            assert seq.start_position == request.num_computed_tokens
            end = seq.start_position + len(seq.token_ids)
            assert seq.token_ids == request.token_ids[seq.start_position:end]
            assert len(seq.block_ids) == -(-end // bs)
            assert seq.needs_logits == (end == request.num_tokens)
        prefix_blocks = set(self.kv.prefix.block_ids) if self.kv.prefix else set()
        private = [b for r in sched.running for b in r.kv.block_ids if b not in prefix_blocks]
        assert len(private) == len(set(private)), "two requests own the same KV block"
