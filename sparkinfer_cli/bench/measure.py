"""The three timed figures of `sparkinfer bench`, each through the real model (and, for throughput,
the real ContinuousBatchEngine): prefill of a prompt, batch-1 decode after it, and the decode
throughput of N sequences together. Prompts are seeded random token ids, never zeros.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sparkinfer_cli.model.batch import SequenceBatch

if TYPE_CHECKING:
    from sparkinfer_cli.engine.engine import ContinuousBatchEngine
    from sparkinfer_cli.engine.request import RequestEvent
    from sparkinfer_cli.engine.sampling_params import SamplingParams
    from sparkinfer_cli.model.backend import ModelBackend
    from sparkinfer_cli.model.cache import ModelCache
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

BLOCK_SIZE = 16
PREFILL_REPEATS = 3  # at most; a repeat starts only while the budget below is not spent
PREFILL_BUDGET_S = 10.0
WARMUP_DECODE_STEPS = 4
WARMUP_ROUNDS = 2
WINDOW_SKIP_STEPS = 2  # first all-decode steps left out of the throughput window (graph capture)


@dataclass(frozen=True)
class Settings:
    decode_steps: int  # batch-1 decode steps timed per depth (median), and the throughput window
    prefill_chunk_tokens: int  # longest prompt piece in one forward pass
    throughput_prompt_tokens: int  # prompt of each concurrent sequence
    seed: int = 0


@dataclass(frozen=True)
class Measurement:
    kind: str  # prefill | decode | throughput
    ctx: int  # prompt tokens (prefill), depth (decode), prompt of each sequence (throughput)
    concurrency: int
    tok_s: float
    tokens_per_pass: int  # tokens one forward pass carries (for the roofline)
    host_us: float | None = None  # decode: mean host time a step until its GPU work is queued


def random_ids(rng: np.random.Generator, n_vocab: int, n: int) -> np.ndarray:
    return rng.integers(0, n_vocab, size=n, dtype=np.int32)  # (n,)


class DepthBench:
    """Prefill and batch-1 decode over one KV cache long enough for the deepest context."""

    def __init__(self, model: ModelBackend, max_ctx: int, settings: Settings):
        self.model, self.settings = model, settings
        self.rng = np.random.default_rng(settings.seed)
        num_blocks = -(-(max_ctx + settings.decode_steps) // BLOCK_SIZE)
        self.cache: ModelCache = model.create_cache(num_blocks, BLOCK_SIZE, 2)
        self.block_table = np.arange(num_blocks, dtype=np.int32)  # (num_blocks,)

    def warm_up(self, prompt_tokens: int) -> None:
        """Compiles the lazily compiled kernels and wakes thread pools: a prompt as long as the
        shortest timed one (kernels switch by token count), decode steps and a 2-sequence batch."""
        n = min(prompt_tokens, self.settings.prefill_chunk_tokens)
        half = self.block_table[len(self.block_table) // 2:]
        for _ in range(WARMUP_ROUNDS):
            ids = self._ids(n)
            self._forward(ids, 0)
            for step in range(WARMUP_DECODE_STEPS):
                self._forward(ids[step:step + 1], n + step)
            if self.model.max_queued_steps > 1:
                self._decode_run(n, WARMUP_DECODE_STEPS)
            pair = SequenceBatch(self._ids(2), [n, 0], [1, 1], [self.block_table, half], [0, 1])
            self.model.forward(pair, self.cache)

    def prefill(self, ctx: int) -> Measurement:
        ids = self._ids(ctx)
        # untimed first: chunks at positions past the warm-up's prompt meet kernels and graphs
        # not made yet, and on a cold cache that one pass would be the only one timed
        self._prefill(ids)
        times: list[float] = []
        while len(times) < PREFILL_REPEATS and \
                sum(times) + max(times, default=0) < PREFILL_BUDGET_S:
            times.append(_timed(lambda: self._prefill(ids)))
        chunk = min(ctx, self.settings.prefill_chunk_tokens)
        return Measurement("prefill", ctx, 1, ctx / statistics.median(times), chunk)

    def decode(self, ctx: int) -> Measurement:
        """Median time a step over decode_steps steps after a ctx-token prompt (just prefilled):
        runs of queued passes (each fed the previous one's argmax, a random first id) where the
        model queues them, as the engine serves greedy requests; else one forward a step."""
        steps, run = self.settings.decode_steps, self.model.max_queued_steps
        host = _HostTime(self.model)
        if run > 1:
            times = [_timed(lambda: self._decode_run(ctx + i, min(run, steps - i)))
                     / min(run, steps - i) for i in range(0, steps, run)]
        else:
            ids = self._ids(steps)
            step = self.model.forward_greedy if self.model.picks_on_device else \
                self.model.forward  # ids back where the device picks them
            times = [_timed(lambda: self._forward(ids[i:i + 1], ctx + i, step))
                     for i in range(steps)]
        return Measurement("decode", ctx, 1, 1.0 / statistics.median(times), 1, host.mean_us())

    def _decode_run(self, start: int, n_steps: int) -> list[np.ndarray]:
        batch = SequenceBatch.single(self._ids(1), start, self.block_table)
        return list(self.model.decode_greedy(batch, self.cache, n_steps))

    def _prefill(self, ids: np.ndarray) -> None:
        if self.model.config.is_hybrid:
            self.cache.reset_state(0)
        step = self.settings.prefill_chunk_tokens
        for start in range(0, len(ids), step):
            self._forward(ids[start:start + step], start)

    def _forward(self, ids: np.ndarray, start: int, run=None) -> np.ndarray:
        """run (default model.forward) over the next ids of the one benchmarked sequence."""
        run = self.model.forward if run is None else run
        return run(SequenceBatch.single(ids, start, self.block_table), self.cache)

    def _ids(self, n: int) -> np.ndarray:
        return random_ids(self.rng, self.model.config.n_vocab, n)


class _HostTime:
    """Host time per graph-replayed decode step since construction, from a model that counts
    it (CudaModel.times: until the step's GPU work is queued); None for other models."""

    def __init__(self, model: ModelBackend):
        self.times = model.times
        if self.times is not None:
            self.start = (self.times.host_s["decode"], self.times.steps["decode"])

    def mean_us(self) -> float | None:
        if self.times is None or self.times.steps["decode"] == self.start[1]:
            return None
        return ((self.times.host_s["decode"] - self.start[0])
                / (self.times.steps["decode"] - self.start[1]) * 1e6)


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()  # NOTE: forward / forward_greedy return host arrays: the device has finished
    return time.perf_counter() - start


# ---- throughput through the engine ---------------------------------------------------------------
Event = tuple[float, str, int, bool]  # (time, request id, output tokens so far, finished)


def measure_throughput(model: ModelBackend, tokenizer: Tokenizer, concurrency: int,
                       settings: Settings) -> Measurement:
    """concurrency greedy requests at once; tokens/s while all of them decode together."""
    from sparkinfer_cli.engine.engine import ContinuousBatchEngine, EngineConfig
    from sparkinfer_cli.engine.sampling_params import SamplingParams

    prompt = settings.throughput_prompt_tokens
    max_tokens = throughput_max_tokens(concurrency, settings)
    blocks_per_seq = -(-(prompt + max_tokens) // BLOCK_SIZE)
    config = EngineConfig(ctx=concurrency * blocks_per_seq * BLOCK_SIZE, block_size=BLOCK_SIZE,
                          max_batch_tokens=concurrency + prompt, max_num_seqs=concurrency,
                          max_output_tokens=max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(settings.seed + concurrency)
    prompts = [random_ids(rng, model.config.n_vocab, prompt).tolist() for _ in range(concurrency)]
    events = _run_requests(ContinuousBatchEngine(model, tokenizer, config), prompts, params)
    tok_s = decode_throughput(events, WINDOW_SKIP_STEPS)
    return Measurement("throughput", prompt, concurrency, tok_s, concurrency)


def throughput_max_tokens(concurrency: int, settings: Settings) -> int:
    # NOTE: one prefill joins per step, so request k decodes from step k on: the window in which
    # all of them decode is max_tokens − concurrency steps long
    return concurrency + WINDOW_SKIP_STEPS + settings.decode_steps


def _run_requests(engine: ContinuousBatchEngine, prompts: Sequence[list[int]],
                  params: SamplingParams) -> list[Event]:
    events: list[Event] = []
    errors: list[str] = []
    done = threading.Semaphore(0)

    def on_event(event: RequestEvent) -> None:  # engine thread
        events.append((time.monotonic(), event.request_id, event.num_output_tokens,
                       event.finish_reason is not None))
        if event.finish_reason is not None:
            if event.finish_reason != "length":
                errors.append(f"{event.finish_reason}: {event.error}")
            done.release()

    engine.start()
    try:
        for ids in prompts:
            engine.submit(ids, params, on_event)
        for _ in prompts:
            done.acquire()
    finally:
        engine.shutdown()
    if errors:
        raise RuntimeError(f"a throughput request failed: {errors[0]}")
    return events


def decode_throughput(events: Sequence[Event], skip_steps: int = 0) -> float:
    """Output tokens/s over all requests between the moment the last one got its first token
    (plus skip_steps more) and the moment the first one finished: every request decodes then."""
    requests = {request_id for _, request_id, _, _ in events}
    start = {r: min((t for t, rid, n, _ in events if rid == r and n >= 1 + skip_steps),
                    default=float("inf")) for r in requests}
    finished = {r: min(t for t, rid, _, fin in events if rid == r and fin) for r in requests}
    t0, t1 = max(start.values()), min(finished.values())
    if t1 <= t0:
        raise RuntimeError("no span in which all sequences decoded together; raise decode steps")

    def tokens_at(r: str, t: float) -> int:
        return max((n for te, rid, n, _ in events if rid == r and te <= t), default=0)

    return sum(tokens_at(r, t1) - tokens_at(r, t0) for r in requests) / (t1 - t0)
