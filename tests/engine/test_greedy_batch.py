"""GreedyBatch against np.argmax row by row, and the engine sampling greedy rows through it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from fake_model import FakeModel, expected_greedy, make_tokenizer

from sparkinfer_cli.engine import greedy_batch
from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.engine import ContinuousBatchEngine
from sparkinfer_cli.engine.greedy_batch import GreedyBatch
from sparkinfer_cli.engine.sampling_params import SamplingParams


def reference(row: np.ndarray) -> int | None:
    values = row.astype(np.float64).tolist()
    best = max(range(len(values)), key=lambda i: (values[i], -i))  # lowest id among the largest
    finite = all(not np.isnan(v) for v in values) and np.isfinite(values[best])
    return best if finite else None


@pytest.mark.parametrize("num_threads", [1, 3])
@pytest.mark.parametrize("num_rows", [0, 3, 13])
def test_tokens_are_each_rows_argmax_or_none_when_not_finite(num_threads, num_rows):
    rng = np.random.default_rng(num_rows)
    rows = [np.round(rng.standard_normal(700), 1).astype(np.float32) for _ in range(num_rows)]
    for i, bad in zip(range(1, num_rows, 4), [np.nan, np.inf, -np.inf]):
        rows[i][rng.integers(700) if bad != -np.inf else slice(None)] = bad
    batch = GreedyBatch(num_threads)
    try:
        assert batch.tokens(rows) == [reference(row) for row in rows]
    finally:
        batch.shutdown()


def test_engine_samples_plain_greedy_rows_on_the_argmax_threads(monkeypatch):
    threads = set()
    argmax_rows = greedy_batch.argmax_rows
    monkeypatch.setattr(greedy_batch, "argmax_rows", lambda rows: threads.add(
        threading.current_thread().name) or argmax_rows(rows))
    engine = ContinuousBatchEngine(FakeModel(), make_tokenizer(),
                                   EngineConfig(ctx=2048, block_size=8, sampling_threads=3))
    done, results = threading.Semaphore(0), {}

    def on_event(event):
        results.setdefault(event.request_id, []).extend(event.token_ids)
        if event.finish_reason:
            done.release()

    prompts = [[(5 * i + j) % 50 for j in range(1 + i % 7)] for i in range(24)]
    params = [SamplingParams(max_tokens=40, temperature=0.0, logprobs=i % 5 == 0,
                             repetition_penalty=1.2 if i % 7 == 0 else 1.0) for i in range(24)]
    ids = [engine.submit(p, s, on_event) for p, s in zip(prompts, params)]  # one prefill a step
    engine.start()
    try:
        for _ in ids:
            assert done.acquire(timeout=20)
        assert [results[i] for i in ids] == [expected_greedy(p, 40) for p in prompts]
        assert any(name.startswith("sparkinfer-argmax") for name in threads)
    finally:
        engine.shutdown()


class DeviceGreedyModel(FakeModel):
    """A FakeModel that, like CudaModel.forward_greedy, can return argmax ids instead of logits."""

    picks_on_device = True

    def __init__(self):
        super().__init__()
        self.passes: list[str] = []

    def forward(self, batch, cache):
        self.passes.append("logits")
        return super().forward(batch, cache)

    def forward_greedy(self, batch, cache):
        logits = super().forward(batch, cache)  # (num_seqs, n_vocab)
        self.passes.append("greedy")
        return np.argmax(logits, axis=1).astype(np.int32)  # (num_seqs,)


def run_all(engine, prompts, params):
    done, results = threading.Semaphore(0), {}

    def on_event(event):
        results.setdefault(event.request_id, []).extend(event.token_ids)
        if event.finish_reason:
            done.release()

    ids = [engine.submit(p, s, on_event) for p, s in zip(prompts, params)]
    engine.start()
    try:
        for _ in ids:
            assert done.acquire(timeout=20)
    finally:
        engine.shutdown()
    return [results[i] for i in ids]


@pytest.mark.parametrize("mixed", [False, True])
def test_steps_of_plain_greedy_rows_let_the_model_pick_the_tokens(mixed):
    model = DeviceGreedyModel()
    engine = ContinuousBatchEngine(model, make_tokenizer(), EngineConfig(ctx=2048, block_size=8))
    prompts = [[(3 * i + j) % 50 for j in range(2 + i % 5)] for i in range(10)]
    logprobs = [mixed and i == 3 for i in range(10)]  # its row must come back: logits
    params = [SamplingParams(max_tokens=1 if lp else 5, temperature=0.0, logprobs=lp)
              for lp in logprobs]
    assert run_all(engine, prompts, params) == \
        [expected_greedy(p, s.max_tokens) for p, s in zip(prompts, params)]
    assert set(model.passes) == ({"greedy", "logits"} if mixed else {"greedy"})
