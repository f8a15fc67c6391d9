"""qwen3moe / qwen35moe / qwen35 / qwen3next vs llama.cpp's oracle logits (tests/fixtures/tiny).

Bars (tests/fixtures/ORACLE_README.md):
- `lc_<V>_deqf32_logits_*` is llama.cpp itself on the dequantized weights with float activations,
  i.e. exactly this engine's math: max |Δlogit| ≤ 1e-3 at every prompt position, in one pass.
- Decode: prefill the short prompt, then feed llama.cpp's (deqf32) greedy tokens one by one; each
  step equals the one-pass logits of the whole sequence and picks llama.cpp's next greedy token.
- `lc_<V>_logits_*` / `lc_<V>_decode_logits_short` are llama.cpp's native quantized runs, which
  also quantize activations: top-1 must agree wherever llama.cpp's top-1 margin is clear (> 0.1,
  or the largest margin at which llama.cpp's own deqf32 run disagrees with native, if larger).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import load_model

TINY = Path(__file__).parent.parent / "fixtures" / "tiny"
FAMILIES = ("qwen3moe", "qwen35moe", "qwen35", "qwen3next")
PROMPTS = ("short", "long")
DEQF32_TOL = 1e-3
DECODE_VS_BATCH_TOL = 1e-4
NATIVE_MARGIN = 0.1
BLOCK_SIZE = 16


@functools.lru_cache(maxsize=None)
def _goldens(family: str) -> dict[str, np.ndarray]:
    with np.load(TINY / family / f"{family}.goldens.npz") as npz:
        return dict(npz)


def _variants(family: str) -> list[str]:
    """Every GGUF variant with llama.cpp logits in the goldens (F32 counts as its own deqf32)."""
    keys = _goldens(family)
    return [k[len("lc_"):-len("_logits_short")] for k in keys
            if k.startswith("lc_") and k.endswith("_logits_short") and "deqf32" not in k
            and "f16kv" not in k and "decode" not in k]


CASES = [(f, v) for f in FAMILIES for v in _variants(f)]


@functools.lru_cache(maxsize=None)
def _model(family: str, variant: str):
    return load_model(TINY / family / f"{family}-{variant}.gguf")


@functools.lru_cache(maxsize=None)
def _prompt_logits(family: str, variant: str, prompt: str) -> np.ndarray:
    """One-pass logits of a golden prompt (shared by the tests below)."""
    return _prefill(_model(family, variant), _goldens(family)[f"prompt_{prompt}"])


def _float_reference(g, variant: str, prompt: str) -> np.ndarray:
    key = "F32" if variant == "F32" else f"{variant}_deqf32"
    return g[f"lc_{key}_logits_{prompt}"]


def _greedy_reference(g, variant: str) -> np.ndarray:
    key = "F32" if variant == "F32" else f"{variant}_deqf32"
    return g[f"lc_{key}_greedy_short"]


def _prefill(model, ids: np.ndarray, cache=None, slot: int = 0) -> np.ndarray:
    cache = cache if cache is not None else model.create_cache(_blocks_for(len(ids)), BLOCK_SIZE, 1)
    batch = SequenceBatch.single(ids, 0, np.arange(cache.num_blocks), slot, all_logits=True)
    return model.forward(batch, cache)  # (T, n_vocab)


def _blocks_for(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK_SIZE)


def _top1_margin(logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(logits.astype(np.float32), axis=-1)[:, -2:]  # (T, 2)
    return top2[:, 1] - top2[:, 0]


@pytest.mark.parametrize("family,variant", CASES)
def test_prefill_matches_llama_cpp_on_dequantized_weights(family: str, variant: str) -> None:
    g = _goldens(family)
    for prompt in PROMPTS:
        ours = _prompt_logits(family, variant, prompt)
        delta = float(np.abs(ours - _float_reference(g, variant, prompt)).max())
        assert delta <= DEQF32_TOL, (f"{family} {variant} {prompt} prompt: max |Δlogit| = "
                                     f"{delta:.3g} vs llama.cpp deqf32 (bar {DEQF32_TOL})")


@pytest.mark.parametrize("family,variant", CASES)
def test_decode_steps_match_batch_and_llama_cpp_greedy(family: str, variant: str) -> None:
    g, model = _goldens(family), _model(family, variant)
    prompt, greedy = g["prompt_short"], _greedy_reference(g, variant)
    full = np.concatenate([prompt, greedy])
    batch_logits = _prefill(model, full)[len(prompt) - 1:]  # (G + 1, V): rows that pick greedy[i]
    cache = model.create_cache(_blocks_for(len(full)), BLOCK_SIZE, 1)
    table = np.arange(cache.num_blocks)
    steps = [model.forward(SequenceBatch.single(prompt, 0, table), cache)[0]]
    for i, token in enumerate(greedy):
        step = SequenceBatch.single(np.array([token]), len(prompt) + i, table)
        steps.append(model.forward(step, cache)[0])
    steps = np.stack(steps)  # (G + 1, V)
    delta = float(np.abs(steps - batch_logits).max())
    assert delta <= DECODE_VS_BATCH_TOL, (f"{family} {variant}: decode steps vs one-pass logits "
                                          f"max |Δ| = {delta:.3g}")
    picked = steps[:-1].argmax(axis=1)
    clear = _top1_margin(steps[:-1]) > DEQF32_TOL
    wrong = np.flatnonzero(clear & (picked != greedy))
    assert wrong.size == 0, f"{family} {variant}: decode picks differ from llama.cpp at {wrong}"


def _native_margin_bar(g, variant: str) -> float:
    """0.1, or the largest native margin at which llama.cpp's own float run picks another top-1."""
    bar = NATIVE_MARGIN
    for prompt in PROMPTS:
        native = g[f"lc_{variant}_logits_{prompt}"].astype(np.float32)
        flips = native.argmax(1) != _float_reference(g, variant, prompt).argmax(1)
        bar = max(bar, float(_top1_margin(native)[flips].max(initial=0.0)))
    return bar


def _assert_top1_agrees(ours: np.ndarray, native: np.ndarray, bar: float, what: str) -> None:
    native = native.astype(np.float32)
    clear = _top1_margin(native) > bar
    wrong = np.flatnonzero(clear & (ours.argmax(1) != native.argmax(1)))
    delta = np.abs(ours - native)
    assert wrong.size == 0, (f"{what}: top-1 differs from native llama.cpp at positions {wrong} "
                             f"(margin bar {bar:.3g}; max |Δ| {delta.max():.3g}, "
                             f"median {np.median(delta):.3g})")


@pytest.mark.parametrize("family,variant", CASES)
def test_top1_matches_native_llama_cpp_where_margin_is_clear(family: str, variant: str) -> None:
    g, model = _goldens(family), _model(family, variant)
    bar = _native_margin_bar(g, variant)
    for prompt in PROMPTS:
        ours = _prompt_logits(family, variant, prompt)
        _assert_top1_agrees(ours, g[f"lc_{variant}_logits_{prompt}"], bar,
                            f"{family} {variant} {prompt} prompt")
    # native decode row i follows native greedy token i: one pass over prompt + native greedy
    prompt = g["prompt_short"]
    full = np.concatenate([prompt, g[f"lc_{variant}_greedy_short"]])
    ours = _prefill(model, full)[len(prompt):]  # (G, V)
    _assert_top1_agrees(ours, g[f"lc_{variant}_decode_logits_short"], bar,
                        f"{family} {variant} decode steps")
