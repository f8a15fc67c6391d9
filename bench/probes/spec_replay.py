"""Speculative decoding's speed path at a fixed acceptance, on any model (synthetic included):
batch-1 greedy decode tok/s without drafts and with replay drafts (the tokens the model is known
to produce, each drafted token wrong with probability 1 − q), and what a pass that checks k
drafts costs against a decode pass.

    python bench/probes/spec_replay.py qwen3.6-35b-a3b OUT.json [--device cuda] [--q 0.83]
        [--spec-tokens 3] [--prompt 512] [--max-tokens 256] [--repeats 3] [--trace DIR]

Synthetic weights accept almost no n-gram draft, so the draft source is replaced by a replay of
the answer the same engine gave without drafts (the scheduler's Drafter, replaced): the check's
arithmetic, the passes and the engine's bookkeeping are those of real
speculation, only the guesses are made up. q 0.83 with 3 drafts keeps ≈ 70 % of the drafted
tokens. Off and on alternate; a rate is the median over the repeats, timed from the first token
to the last as the answer streams. --trace DIR writes each engine's step trace (StepTrace) and a
cProfile of the drafting engine's thread (where a drafted step's host time goes).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from spec_acceptance import answer  # noqa: E402

from sparkinfer_cli.bench.runner import ensure_synthetic  # noqa: E402
from sparkinfer_cli.engine.engine import ContinuousBatchEngine, EngineConfig  # noqa: E402
from sparkinfer_cli.engine.sampling_params import SamplingParams  # noqa: E402
from sparkinfer_cli.engine.speculative import Drafter  # noqa: E402
from sparkinfer_cli.gguf.reader import GGUFFile  # noqa: E402
from sparkinfer_cli.model.batch import SequenceBatch  # noqa: E402
from sparkinfer_cli.model.loader import load_model  # noqa: E402
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer  # noqa: E402


class ReplayDrafts(Drafter):
    """Drafts from a known continuation: position p's draft is known[p], or a wrong token with
    probability 1 − q (decided once per position, so repeats see the same drafts)."""

    def __init__(self, known: list[int], q: float, n_vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        wrong = rng.random(len(known)) > q
        self.tokens = [(t + 1) % n_vocab if w else t for t, w in zip(known, wrong)]

    def drafts(self, wants, step_room: int) -> list[list[int]]:
        found = []
        for request, limit in wants:
            start, most = request.num_tokens, max(min(limit, step_room), 0)
            found.append(self.tokens[start:start + most])
            step_room -= len(found[-1])
        return found


def pass_costs(model, n_rows: int, ks: list[int], reps: int = 50) -> dict[int, float]:
    """Mean ms of a synced greedy pass of one sequence checking k drafts (k + 1 rows, a logit
    row each) at position n_rows, for each k (k = 0: a decode pass)."""
    cache = model.create_cache(-(-(n_rows + 16) // 16), 16, 2)
    table = np.arange(cache.num_blocks, dtype=np.int32)
    ids = np.arange(n_rows + 16, dtype=np.int32) % model.config.n_vocab
    model.forward(SequenceBatch.single(ids[:n_rows], 0, table, 0), cache)
    costs = {}
    for k in ks:
        batch = SequenceBatch(ids[n_rows:n_rows + k + 1], [n_rows], [k + 1], [table],
                              [0] if model.config.is_hybrid else [], logit_counts=[k + 1])
        for _ in range(3):  # capture, then warm replays
            model.forward_greedy(batch, cache)
        start = time.perf_counter()
        for _ in range(reps):
            model.forward_greedy(batch, cache)
        costs[k] = (time.perf_counter() - start) / reps * 1e3
    return costs


def profile_thread(engine: ContinuousBatchEngine, path: Path) -> None:
    """Profiles the engine's thread (its loop) with cProfile, dumped to path when it exits."""
    loop = engine._loop

    def profiled_loop() -> None:
        profiler = cProfile.Profile()
        try:
            profiler.runcall(loop)
        finally:
            profiler.dump_stats(str(path))

    engine._loop = profiled_loop  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", help="a synthetic preset, or a GGUF path")
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--q", type=float, default=0.83)
    parser.add_argument("--spec-tokens", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trace", type=Path, help="folder for step traces and a profile")
    args = parser.parse_args()
    path = Path(args.preset) if args.preset.endswith(".gguf") else \
        ensure_synthetic(args.preset, Console(stderr=True))
    gguf = GGUFFile(path)
    model, tokenizer = load_model(gguf, args.device), Tokenizer.from_gguf(gguf)
    costs = pass_costs(model, args.prompt, [0, 1, 3]) if args.device == "cuda" else {}
    print("pass ms by drafts checked:", {k: round(v, 3) for k, v in costs.items()}, flush=True)
    if args.trace:
        args.trace.mkdir(parents=True, exist_ok=True)
    engines = {k: ContinuousBatchEngine(model, tokenizer, EngineConfig(
        ctx=args.prompt + args.max_tokens + 64, spec_tokens=k, prefix_cache=False,
        max_num_seqs=1, step_trace=str(args.trace / f"steps-k{k}.jsonl") if args.trace else ""))
        for k in (0, args.spec_tokens)}
    if args.trace:
        profile_thread(engines[args.spec_tokens], args.trace / "drafting-engine.prof")
    for engine in engines.values():
        engine.start()
    rng = np.random.default_rng(1)
    prompt = rng.integers(256, min(model.config.n_vocab, 32000), args.prompt).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    try:
        plain, _ = answer(engines[0], prompt, params)  # warm-up; the continuation to replay
        engines[args.spec_tokens].scheduler.drafter = ReplayDrafts(prompt + plain, args.q,
                                                                   model.config.n_vocab)
        rates: dict[int, list[float]] = {k: [] for k in engines}
        same = True
        before = engines[args.spec_tokens].stats().speculation
        for _ in range(args.repeats):
            for k, engine in engines.items():
                ids, rate = answer(engine, prompt, params)
                rates[k].append(rate)
                same &= ids == plain
        drafts = engines[args.spec_tokens].stats().speculation.since(before)
    finally:
        for engine in engines.values():
            engine.shutdown()
    off, on = (statistics.median(rates[k]) for k in engines)
    result = {"model": args.preset, "device": args.device, "q": args.q,
              "spec_tokens": args.spec_tokens, "prompt_tokens": args.prompt,
              "max_tokens": args.max_tokens, "repeats": args.repeats,
              "pass_ms_by_drafts": costs, "decode_tok_s_off": off, "decode_tok_s_on": on,
              "speedup": on / off, "acceptance_rate": drafts.acceptance_rate,
              "mean_accepted_length": drafts.mean_accepted_length, "checks": drafts.num_drafts,
              "same_answer": same, "rates": {str(k): v for k, v in rates.items()}}
    print(f"{args.preset}: {off:.1f} → {on:.1f} tok/s ({on / off:.2f}×), "
          f"{100 * drafts.acceptance_rate:.0f} % of drafts kept, "
          f"{drafts.mean_accepted_length:.2f} tokens a check, same answer: {same}", flush=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
