"""Dense qwen3 logits against the oracle fixtures (transformers, llama.cpp), every variant.

References (tests/fixtures/ORACLE_README.md): F32 → `hf_logits_*` (transformers fp32) and
`lc_F32_decode_logits_short`; a quantized variant V → `lc_V_deqf32_logits_*` (llama.cpp on the
same weights dequantized to F32). Native `lc_V_logits_*` also quantize activations, so against
them only the top-1 is compared, where llama.cpp's own top-1 margin exceeds 0.1.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import load_model

TOL = 1e-3
MARGIN = 0.1
VARIANTS = ["F32", "Q8_0", "Q6_K", "Q4_K_M"]
BLOCK_SIZE, NUM_BLOCKS = 16, 16


@pytest.fixture(scope="module")
def goldens(fixtures_dir):
    return np.load(fixtures_dir / "tiny/qwen3/qwen3.goldens.npz")


@pytest.fixture(scope="module", params=VARIANTS)
def variant_model(request, fixtures_dir):
    return request.param, load_model(fixtures_dir / f"tiny/qwen3/qwen3-{request.param}.gguf")


def prefill_all_logits(model, ids: np.ndarray) -> np.ndarray:
    cache = model.create_cache(NUM_BLOCKS, BLOCK_SIZE, 1)
    return model.forward(SequenceBatch.single(ids, 0, np.arange(NUM_BLOCKS), all_logits=True),
                         cache)


def decode_logits(model, prompt: np.ndarray, fed: np.ndarray) -> np.ndarray:
    """Prefill `prompt`, then feed `fed` one token a step; logits of the prompt end + each step."""
    cache, table = model.create_cache(NUM_BLOCKS, BLOCK_SIZE, 1), np.arange(NUM_BLOCKS)
    rows = [model.forward(SequenceBatch.single(prompt, 0, table), cache)[0]]
    for i, token in enumerate(fed):
        rows.append(model.forward(SequenceBatch.single([token], len(prompt) + i, table), cache)[0])
    return np.stack(rows)  # (len(fed) + 1, V)


def top1_margin(logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(logits.astype(np.float32), axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def reference(goldens, variant: str, which: str) -> np.ndarray:
    key = f"hf_logits_{which}" if variant == "F32" else f"lc_{variant}_deqf32_logits_{which}"
    return goldens[key].astype(np.float32)


@pytest.mark.parametrize("which", ["short", "long"])
def test_prefill_logits_match_float_reference(variant_model, goldens, which):
    variant, model = variant_model
    logits = prefill_all_logits(model, goldens[f"prompt_{which}"])
    diff = np.abs(logits - reference(goldens, variant, which)).max()
    assert diff <= TOL, f"qwen3 {variant} {which}: max |Δlogit| = {diff:.2e}"


@pytest.mark.parametrize("which", ["short", "long"])
def test_prefill_top1_matches_native_llama_cpp(variant_model, goldens, which):
    variant, model = variant_model
    native = goldens[f"lc_{variant}_logits_{which}"].astype(np.float32)
    logits = prefill_all_logits(model, goldens[f"prompt_{which}"])
    clear = top1_margin(native) > MARGIN
    agree = logits.argmax(-1)[clear] == native.argmax(-1)[clear]
    assert agree.all(), f"qwen3 {variant} {which}: top-1 differs at {np.flatnonzero(~agree)}"


def test_decode_steps_match_llama_cpp(variant_model, goldens):
    """Decode one token at a time along llama.cpp's own greedy path (F32: tight; else top-1)."""
    variant, model = variant_model
    fed = goldens[f"lc_{variant}_greedy_short"]
    native = goldens[f"lc_{variant}_decode_logits_short"].astype(np.float32)  # (G, V)
    # native row i is the step after feeding greedy token i (it picked token i + 1)
    logits = decode_logits(model, goldens["prompt_short"], fed)[1:]
    assert logits.shape == native.shape
    if variant == "F32":
        diff = np.abs(logits - native).max()
        assert diff <= TOL, f"qwen3 F32 decode: max |Δlogit| = {diff:.2e}"
    clear = top1_margin(native) > MARGIN
    assert (logits.argmax(-1)[clear] == native.argmax(-1)[clear]).all()


def test_greedy_continuation_matches_float_reference(variant_model, goldens):
    """Our greedy ids equal llama.cpp's (dequantized-F32 run if quantized), token by token."""
    variant, model = variant_model
    key = "lc_F32_greedy_short" if variant == "F32" else f"lc_{variant}_deqf32_greedy_short"
    expected = goldens[key]
    prompt, table = goldens["prompt_short"], np.arange(NUM_BLOCKS)
    cache = model.create_cache(NUM_BLOCKS, BLOCK_SIZE, 1)
    logits, ours = model.forward(SequenceBatch.single(prompt, 0, table), cache)[0], []
    for i in range(len(expected)):
        ours.append(int(logits.argmax()))
        logits = model.forward(SequenceBatch.single([ours[-1]], len(prompt) + i, table), cache)[0]
    assert ours == expected.tolist()


def test_batched_sequences_equal_solo(goldens, fixtures_dir):
    """Two sequences in one pass (different lengths, own block tables) = each run alone."""
    model = load_model(fixtures_dir / "tiny/qwen3/qwen3-Q4_K_M.gguf")
    a, b = goldens["prompt_short"], goldens["prompt_long"][:45]
    cache = model.create_cache(NUM_BLOCKS, BLOCK_SIZE, 2)
    batch = SequenceBatch(np.concatenate([a, b]).astype(np.int32), [0, 0], [len(a), len(b)],
                          [np.arange(0, 8, dtype=np.int32), np.arange(8, 16, dtype=np.int32)],
                          all_logits=True)
    both = model.forward(batch, cache)
    np.testing.assert_allclose(both[:len(a)], prefill_all_logits(model, a), atol=1e-5)
    np.testing.assert_allclose(both[len(a):], prefill_all_logits(model, b), atol=1e-5)


@pytest.mark.parametrize("variant", ["Q8_0", "Q6_K", "Q4_K_M"])
def test_int8_decode_matches_native_llama_cpp(goldens, fixtures_dir, variant):
    """With int8-activation decode (llama.cpp's scheme, not its exact rounding) the decode steps
    stay within llama.cpp's native-vs-float noise (≤ 0.09 here) and pick the same top-1 wherever
    its margin exceeds 0.1."""
    model = load_model(fixtures_dir / f"tiny/qwen3/qwen3-{variant}.gguf", int8_decode=True)
    fed = goldens[f"lc_{variant}_greedy_short"]
    native = goldens[f"lc_{variant}_decode_logits_short"].astype(np.float32)
    logits = decode_logits(model, goldens["prompt_short"], fed)[1:]
    diff = np.abs(logits - native).max()
    assert diff <= 0.09, f"qwen3 {variant} int8 decode vs native: max |Δlogit| = {diff:.3f}"
    clear = top1_margin(native) > MARGIN
    assert (logits.argmax(-1)[clear] == native.argmax(-1)[clear]).all()
