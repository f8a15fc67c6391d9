"""The CUDA model (model/cuda_runner.py) against llama.cpp's oracle logits and the CPU model.

On the H200 (`pytest -m gpu tests/model/test_cuda_model.py`):
- exact mode (F32 weights, float activations): the CPU tests' bars — max |Δlogit| ≤ 1e-3 vs
  `lc_<V>_deqf32_logits_*` over whole prompts, decode steps (CUDA graphs) equal to one-pass logits
  and llama.cpp's greedy picks;
- default mode (GGUF bytes, q8 activations like llama.cpp's CUDA path, F16 KV): top-1 agrees
  with llama.cpp's native logits wherever its margin is clear;
- a batch of sequences decoded together (one graph, padded bucket) equals each decoded alone;
- the real demo models: greedy continuations on the GPU equal the CPU model's.
Without a GPU, one small case runs in numba's simulator (every kernel of a qwen35moe pass).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from sparkinfer_cli.gguf_file import GGUFFile
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.loader import load_model

TINY = Path(__file__).parent.parent / "fixtures" / "tiny"
FAMILIES = ("qwen3", "qwen3moe", "qwen35moe", "qwen35", "qwen3next")
BLOCK_SIZE = 16
DEQF32_TOL = 1e-3
DECODE_VS_BATCH_TOL = 1e-4
NATIVE_MARGIN = 0.1


@functools.lru_cache(maxsize=None)
def _goldens(family: str) -> dict[str, np.ndarray]:
    with np.load(TINY / family / f"{family}.goldens.npz") as npz:
        return dict(npz)


def _variants(family: str) -> list[str]:
    return [k[len("lc_"):-len("_logits_short")] for k in _goldens(family)
            if k.startswith("lc_") and k.endswith("_logits_short") and "deqf32" not in k
            and "f16kv" not in k and "decode" not in k]


CASES = [(f, v) for f in FAMILIES for v in _variants(f)]


@functools.lru_cache(maxsize=4)
def _gpu_model(path: Path, exact: bool):
    from sparkinfer_cli.model.cuda_runner import load_cuda_model

    gguf = GGUFFile(path)
    return load_cuda_model(gguf, ModelConfig.from_gguf(gguf), exact=exact)


def _tiny(family: str, variant: str, exact: bool):
    return _gpu_model(TINY / family / f"{family}-{variant}.gguf", exact)


def _float_key(variant: str) -> str:
    return "F32" if variant == "F32" else f"{variant}_deqf32"


def _prefill(model, ids: np.ndarray) -> np.ndarray:
    cache = model.create_cache(-(-len(ids) // BLOCK_SIZE), BLOCK_SIZE, 1)
    batch = SequenceBatch.single(ids, 0, np.arange(cache.num_blocks), 0, all_logits=True)
    return model.forward(batch, cache)  # (T, V)


def _top1_margin(logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(logits.astype(np.float32), axis=-1)[:, -2:]  # (T, 2)
    return top2[:, 1] - top2[:, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("family,variant", CASES)
def test_exact_prefill_matches_llama_cpp_dequantized(family: str, variant: str) -> None:
    g, model = _goldens(family), _tiny(family, variant, exact=True)
    for prompt in ("short", "long"):
        ours = _prefill(model, g[f"prompt_{prompt}"])
        delta = float(np.abs(ours - g[f"lc_{_float_key(variant)}_logits_{prompt}"]).max())
        assert delta <= DEQF32_TOL, f"{family} {variant} {prompt}: max |Δlogit| = {delta:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("family,variant", CASES)
def test_exact_decode_graph_steps_match_one_pass_and_greedy(family: str, variant: str) -> None:
    g, model = _goldens(family), _tiny(family, variant, exact=True)
    prompt, greedy = g["prompt_short"], g[f"lc_{_float_key(variant)}_greedy_short"]
    full = np.concatenate([prompt, greedy])
    one_pass = _prefill(model, full)[len(prompt) - 1:]  # (G + 1, V)
    cache = model.create_cache(-(-len(full) // BLOCK_SIZE), BLOCK_SIZE, 1)
    table = np.arange(cache.num_blocks)
    steps = [model.forward(SequenceBatch.single(prompt, 0, table), cache)[0]]
    for i, token in enumerate(greedy):  # one token per pass: CUDA graph replays
        steps.append(model.forward(SequenceBatch.single([token], len(prompt) + i, table), cache)[0])
    steps = np.stack(steps)  # (G + 1, V)
    delta = float(np.abs(steps - one_pass).max())
    assert delta <= DECODE_VS_BATCH_TOL, f"{family} {variant}: decode vs one pass {delta:.3g}"
    clear = _top1_margin(steps[:-1]) > DEQF32_TOL
    wrong = np.flatnonzero(clear & (steps[:-1].argmax(1) != greedy))
    assert wrong.size == 0, f"{family} {variant}: greedy picks differ at {wrong}"


@pytest.mark.gpu
@pytest.mark.parametrize("family,variant", CASES)
def test_q8_top1_matches_native_llama_cpp_where_clear(family: str, variant: str) -> None:
    g, model = _goldens(family), _tiny(family, variant, exact=False)
    for prompt in ("short", "long"):
        native = g[f"lc_{variant}_logits_{prompt}"].astype(np.float32)
        flips = native.argmax(1) != g[f"lc_{_float_key(variant)}_logits_{prompt}"].argmax(1)
        bar = max(NATIVE_MARGIN, float(_top1_margin(native)[flips].max(initial=0.0)))
        ours = _prefill(model, g[f"prompt_{prompt}"])
        wrong = np.flatnonzero((_top1_margin(native) > bar) & (ours.argmax(1) != native.argmax(1)))
        assert wrong.size == 0, (f"{family} {variant} {prompt}: top-1 differs at {wrong}; "
                                 f"max |Δ| {np.abs(ours - native).max():.3g}")


def _decode_alone_and_together(model, prompts: list[np.ndarray], n_steps: int):
    """Greedy logits of each prompt decoded alone, and all decoded in one batch per step."""
    blocks = 4
    def run(group: list[int]) -> dict[int, list[np.ndarray]]:
        cache = model.create_cache(blocks * len(prompts), BLOCK_SIZE, len(prompts))
        tables = {i: np.arange(i * blocks, (i + 1) * blocks) for i in group}
        last = {i: model.forward(SequenceBatch.single(prompts[i], 0, tables[i], i), cache)[0]
                for i in group}
        out = {i: [last[i]] for i in group}
        for step in range(n_steps):
            ids = np.array([last[i].argmax() for i in group], np.int32)
            batch = SequenceBatch(ids, [len(prompts[i]) + step for i in group], [1] * len(group),
                                  [tables[i] for i in group], list(group))
            logits = model.forward(batch, cache)
            for row, i in enumerate(group):
                last[i] = logits[row]
                out[i].append(logits[row])
        return out
    together = run(list(range(len(prompts))))
    alone = {i: run([i])[i] for i in range(len(prompts))}
    return alone, together


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("qwen35moe", "qwen3moe"))
def test_batched_decode_equals_each_sequence_alone(family: str) -> None:
    model = _tiny(family, "Q8_0", exact=True)
    prompt = _goldens(family)["prompt_long"]
    prompts = [prompt[:20], prompt[30:37], prompt[50:83]]  # 3 sequences: a padded bucket of 4
    alone, together = _decode_alone_and_together(model, prompts, n_steps=6)
    for i in range(len(prompts)):
        delta = float(np.abs(np.stack(alone[i]) - np.stack(together[i])).max())
        assert delta <= DECODE_VS_BATCH_TOL, f"{family} sequence {i}: batched vs alone {delta:.3g}"


def _greedy(model, ids: list[int], n: int) -> list[int]:
    cache = model.create_cache(-(-(len(ids) + n) // BLOCK_SIZE), BLOCK_SIZE, 1)
    table = np.arange(cache.num_blocks)
    logits = model.forward(SequenceBatch.single(ids, 0, table), cache)[0]
    out = []
    for i in range(n):
        out.append(int(logits.argmax()))
        logits = model.forward(SequenceBatch.single([out[-1]], len(ids) + i, table), cache)[0]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", ("qwen2.5-coder-0.5b", "smollm2-135m"))
def test_demo_model_greedy_equals_cpu(name: str, demo_model_path) -> None:
    from sparkinfer_cli.tokenizer import Tokenizer

    path = demo_model_path(name)
    ids = Tokenizer.from_gguf(GGUFFile(path)).encode("def fibonacci(n):\n    \"\"\"Return the")
    cpu = _greedy(load_model(path), ids, 24)
    assert _greedy(_gpu_model(path, True), ids, 24) == cpu


def _prefill_then_decode(model, ids: np.ndarray) -> np.ndarray:
    cache = model.create_cache(1, BLOCK_SIZE, 1)
    first = model.forward(SequenceBatch.single(ids[:-1], 0, [0], 0, all_logits=True), cache)
    last = model.forward(SequenceBatch.single(ids[-1:], len(ids) - 1, [0], 0), cache)
    return np.concatenate([first, last])  # (len(ids), V)


@pytest.mark.gpu
def test_qwen35moe_prefill_and_decode_match_cpu() -> None:
    """A short hybrid MoE pass against the CPU model (too slow for the simulator in CI)."""
    path = TINY / "qwen35moe" / "qwen35moe-Q8_0.gguf"
    ids = _goldens("qwen35moe")["prompt_short"][:4]
    cpu = _prefill_then_decode(load_model(path), ids)
    gpu = _prefill_then_decode(_gpu_model(path, True), ids)
    assert np.abs(gpu - cpu).max() <= DEQF32_TOL
