"""The CUDA model (backend/cuda/model.py) against llama.cpp's oracle logits and the CPU model.

On the H200 (`pytest -m gpu tests/backend/cuda/test_cuda_model.py`):
- exact mode (F32 weights, float activations): the CPU tests' bars — max |Δlogit| ≤ 1e-3 vs
  `lc_<V>_deqf32_logits_*` over whole prompts, decode steps (CUDA graphs) equal to one-pass logits
  and llama.cpp's greedy picks;
- default mode (GGUF bytes, q8 activations like llama.cpp's CUDA path, F16 KV): top-1 agrees
  with llama.cpp's native logits wherever its margin is clear, with the linears as GEMVs and as
  tensor-core GEMMs (the latter is what passes of ≥ LINEAR_MMA_MIN_ROWS tokens run), and with
  the prompt decoded a token a pass;
- a batch of sequences decoded together (one graph, padded bucket) equals each decoded alone;
- the real demo models: greedy continuations on the GPU equal the CPU model's.
Without a GPU, one small case runs in numba's simulator (every kernel of a qwen35moe pass).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.model.batch import DeviceDraw, SamplingRows, SequenceBatch
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.loader import load_model

TINY = Path(__file__).parents[2] / "fixtures" / "tiny"
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
def _gpu_model(path: Path, exact: bool, kv_int8: bool = False):
    from sparkinfer_cli.backend.cuda.model import load_cuda_model

    gguf = GGUFFile(path)
    return load_cuda_model(gguf, ModelConfig.from_gguf(gguf), exact=exact, kv_int8=kv_int8)


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
    """Each prompt twice: the first pass of its row bucket runs eagerly (and is captured), the
    second replays the captured graph."""
    g, model = _goldens(family), _tiny(family, variant, exact=True)
    for prompt in ("short", "long", "short", "long"):
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
@pytest.mark.parametrize("family", ("qwen3", "qwen35moe"))
def test_forward_greedy_ids_are_the_argmax_of_the_logits(family: str) -> None:
    """Device argmax (forward_greedy) vs numpy argmax of forward's logits, on two caches fed the
    same llama.cpp greedy continuation (decode steps replay graphs)."""
    g = _goldens(family)
    model = _tiny(family, _variants(family)[0], exact=False)
    prompt = g["prompt_short"]
    tokens = g[f"lc_{_float_key(_variants(family)[0])}_greedy_short"][:6]
    caches = [model.create_cache(-(-(len(prompt) + 8) // BLOCK_SIZE), BLOCK_SIZE, 1)
              for _ in range(2)]
    table = np.arange(caches[0].num_blocks)
    pieces = [(prompt, 0)] + [([t], len(prompt) + i) for i, t in enumerate(tokens)]
    for ids, start in pieces:
        ids = np.asarray(ids, np.int32)
        logits = model.forward(SequenceBatch.single(ids, start, table), caches[0])
        picked = model.forward_greedy(SequenceBatch.single(ids, start, table), caches[1])
        assert picked.tolist() == logits.argmax(axis=1).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("qwen3", "qwen35moe"))
def test_int8_kv_decode_follows_f16_kv_where_clear(family: str) -> None:
    """SPARKINFER_KV_INT8: decode logits over an int8 cache pick F16's top-1 wherever F16's
    margin is clear (F16 KV is the path checked against llama.cpp above)."""
    g, variant = _goldens(family), _variants(family)[0]
    path = TINY / family / f"{family}-{variant}.gguf"
    prompt = g["prompt_short"]
    tokens = g[f"lc_{_float_key(variant)}_greedy_short"]

    def decode(model) -> np.ndarray:
        cache = model.create_cache(-(-(len(prompt) + len(tokens)) // BLOCK_SIZE), BLOCK_SIZE, 1)
        table = np.arange(cache.num_blocks)
        steps = [model.forward(SequenceBatch.single(prompt, 0, table), cache)[0]]
        for i, token in enumerate(tokens[:-1]):
            batch = SequenceBatch.single([token], len(prompt) + i, table)
            steps.append(model.forward(batch, cache)[0])
        return np.stack(steps)  # (len(tokens), V)

    f16, int8 = decode(_gpu_model(path, False)), decode(_gpu_model(path, False, kv_int8=True))
    assert np.abs(f16 - int8).max() > 0, "the int8 model did not use an int8 cache"
    clear = _top1_margin(f16) > NATIVE_MARGIN
    assert (f16.argmax(1) == int8.argmax(1))[clear].all()


@pytest.mark.gpu
@pytest.mark.parametrize("tensor_cores", (False, True))
@pytest.mark.parametrize("family,variant", CASES)
def test_q8_top1_matches_native_llama_cpp_where_clear(family: str, variant: str,
                                                      tensor_cores: bool, monkeypatch) -> None:
    """tensor_cores: every linear of the prefill as an mma GEMM (f16 activations), not a GEMV."""
    from sparkinfer_cli.backend.cuda import linears as cuda_linears

    for name in ("EXPERTS_MMA_MIN_ROWS", "LINEAR_MMA_MIN_ROWS"):
        monkeypatch.setattr(cuda_linears, name, 1 if tensor_cores else 1 << 30)
    g, model = _goldens(family), _tiny(family, variant, exact=False)
    for prompt in ("short", "long"):
        _assert_native_top1_where_clear(family, variant, prompt,
                                        _prefill(model, g[f"prompt_{prompt}"]))


@pytest.mark.gpu
@pytest.mark.parametrize("family,variant", CASES)
def test_q8_decode_top1_matches_native_llama_cpp_where_clear(family: str, variant: str) -> None:
    """The short prompt fed one token a pass (decode graphs: each token's K/V stored in the F16
    cache, the split-K decode kernel over it, the GEMVs on q8 activations) against llama.cpp's
    native logits of the whole prompt (its batched pass), as the prefill above."""
    g, model = _goldens(family), _tiny(family, variant, exact=False)
    ids = g["prompt_short"]
    cache = model.create_cache(-(-len(ids) // BLOCK_SIZE), BLOCK_SIZE, 1)
    table = np.arange(cache.num_blocks)
    ours = np.stack([model.forward(SequenceBatch.single([t], i, table), cache)[0]
                     for i, t in enumerate(ids)])  # (T, V)
    _assert_native_top1_where_clear(family, variant, "short", ours)


def _assert_native_top1_where_clear(family: str, variant: str, prompt: str, ours) -> None:
    """ours (T, V) picks llama.cpp's native top-1 wherever its margin clears the bar (NATIVE_MARGIN
    or the largest margin at which llama.cpp's own native and dequantized-f32 picks differ)."""
    g = _goldens(family)
    native = g[f"lc_{variant}_logits_{prompt}"].astype(np.float32)
    flips = native.argmax(1) != g[f"lc_{_float_key(variant)}_logits_{prompt}"].argmax(1)
    bar = max(NATIVE_MARGIN, float(_top1_margin(native)[flips].max(initial=0.0)))
    wrong = np.flatnonzero((_top1_margin(native) > bar) & (ours.argmax(1) != native.argmax(1)))
    assert wrong.size == 0, (f"{family} {variant} {prompt}: top-1 differs at {wrong}; "
                             f"max |Δ| {np.abs(ours - native).max():.3g}")


def _decode_group(model, prompts: list[np.ndarray], group: list[int], n_steps: int):
    """Greedy logits of the prompts in `group` (prefilled one by one), decoded together in one
    batch per step: {prompt index: [logits after the prompt, after step 1, ...]}."""
    blocks = 4
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


def _decode_alone_and_together(model, prompts: list[np.ndarray], n_steps: int):
    """Greedy logits of each prompt decoded alone, and all decoded in one batch per step."""
    together = _decode_group(model, prompts, list(range(len(prompts))), n_steps)
    alone = {i: _decode_group(model, prompts, [i], n_steps)[i] for i in range(len(prompts))}
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


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("qwen35moe", "qwen3moe"))
def test_quantized_decode_below_the_gemm_rows_is_bit_identical_alone_and_batched(
        family: str, monkeypatch) -> None:
    """Quantized mode, as the server runs: a decode of fewer rows than LINEAR_MMA_MIN_ROWS runs
    every linear as a GEMV whose sums keep the order their matrix fixes, so each sequence's
    logits are bit for bit those of decoding it alone, even where the batch narrows the experts'
    lanes (a lane budget that 3 sequences' expert slots pass and one sequence's do not)."""
    from sparkinfer_cli.kernels.cuda import quant_gemv as qg

    monkeypatch.setattr(qg, "LANE_BUDGET", 2048)  # expert gate/up: 64 rows × 8 lanes × slots
    model = _gpu_model.__wrapped__(TINY / family / f"{family}-Q8_0.gguf", False)  # own graphs
    prompt = _goldens(family)["prompt_long"]
    prompts = [prompt[:20], prompt[30:37], prompt[50:83]]  # 3 sequences: a padded bucket of 4
    alone, together = _decode_alone_and_together(model, prompts, n_steps=6)
    for i in range(len(prompts)):
        np.testing.assert_array_equal(np.stack(together[i]), np.stack(alone[i]),
                                      err_msg=f"{family} sequence {i}")


@pytest.mark.gpu
def test_linears_on_tensor_cores_in_a_batched_decode_graph(monkeypatch) -> None:
    """33 sequences decode together: a bucket of 64 rows, where every dense linear (the output
    projection included) runs as a tensor-core GEMM, k split over the grid, inside the captured
    graph: the tiny model's Q8_0 linears (k 256) on int8 tensor cores (mmq_q8, q8 activations
    like the GEMVs), others on f16 tiles (mma_gemm). The first decode step's logits (same inputs
    either way) follow the same step with the linears as GEMVs: top-1 equal where clear and close
    elsewhere. MIN_SPLIT_STEPS 1: mma_gemm splits the tiny model's k of a few steps too."""
    from sparkinfer_cli.backend.cuda import linears as cuda_linears
    from sparkinfer_cli.kernels.cuda import mma_gemm

    monkeypatch.setattr(mma_gemm, "MIN_SPLIT_STEPS", 1)

    model = _tiny("qwen3", "Q8_0", exact=False)
    prompt = _goldens("qwen3")["prompt_long"]
    prompts = [prompt[i:i + 4 + i % 5] for i in range(33)]
    group = list(range(len(prompts)))
    first_step = {}
    for path, min_rows in (("mma", cuda_linears.LINEAR_MMA_MIN_ROWS), ("gemv", 1 << 30)):
        monkeypatch.setattr(cuda_linears, "LINEAR_MMA_MIN_ROWS", min_rows)
        out = _decode_group(model, prompts, group, n_steps=1)
        first_step[path] = np.stack([out[i][1] for i in group])  # (33, n_vocab)
    mma, gemv = first_step["mma"], first_step["gemv"]
    top2 = np.sort(gemv, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > NATIVE_MARGIN
    assert clear.sum() >= len(group) // 2, "too few clear rows to compare top-1"
    assert (mma.argmax(1) == gemv.argmax(1))[clear].all()
    assert np.abs(mma - gemv).max() <= 0.05 * np.abs(gemv).max()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("qwen3", "qwen35moe"))
def test_queued_decode_passes_equal_greedy_steps_one_by_one(family: str) -> None:
    """decode_greedy (passes queued at once, each fed the previous pass's ids on the device)
    picks what forward_greedy picks step by step with the host feeding the ids, for 3 sequences
    (a padded bucket of 4), over two runs of passes (graph capture, then replays)."""
    from sparkinfer_cli.backend.cuda.workspace import MAX_QUEUED_STEPS

    model = _tiny(family, "Q8_0", exact=False)
    picks = {}
    for mode in ("one by one", "queued"):
        cache, batch = _three_prefilled_sequences(model, family)
        tables = batch.block_tables
        steps: list[np.ndarray] = []
        for _ in range(2):
            run = list(model.decode_greedy(batch, cache, MAX_QUEUED_STEPS)) if mode == "queued" \
                else _greedy_steps(model, batch, cache, MAX_QUEUED_STEPS)
            steps += run
            batch = SequenceBatch(run[-1], [s + MAX_QUEUED_STEPS for s in batch.start_positions],
                                  [1] * 3, tables, [0, 1, 2])
        picks[mode] = np.stack(steps)  # (2 · MAX_QUEUED_STEPS, 3)
    np.testing.assert_array_equal(picks["queued"], picks["one by one"])


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("qwen3", "qwen35moe"))
def test_queued_drawn_passes_equal_sampled_steps_one_by_one(family: str) -> None:
    """decode_drawn (each pass's forward queued before the previous pass's ids reach the host,
    its draw launched once its rows come) picks what forward_sampled picks step by step, where a
    step's rows depend on the ids before it as a grammar's mask does: a greedy row allowed only
    the other parity than its previous token, a top-k row with a u of its own each step, and an
    argmax row."""
    from sparkinfer_cli.backend.cuda.workspace import MAX_QUEUED_STEPS
    from sparkinfer_cli.model.batch import ARGMAX, mask_words

    model = _tiny(family, "Q8_0", exact=False)
    n_vocab = model.config.n_vocab

    def rows_after(previous: np.ndarray, step: int) -> SamplingRows:
        allowed = np.zeros(mask_words(n_vocab) * 32, bool)
        allowed[:n_vocab] = np.arange(n_vocab) % 2 != previous[0] % 2
        words = np.packbits(allowed, bitorder="little").view(np.uint32)
        return SamplingRows.of([ARGMAX, DeviceDraw(0.9, 8, 1.0, 0.0, 0.137 * (step + 1) % 1.0),
                                ARGMAX], [words, None, None])

    picks = {}
    for mode in ("one by one", "queued"):
        cache, batch = _three_prefilled_sequences(model, family)
        first = batch.token_ids
        seen = [first]  # a step's rows read the ids before it: asked for early, an IndexError
        if mode == "queued":
            for ids in model.decode_drawn(batch, cache, MAX_QUEUED_STEPS,
                                          lambda step: rows_after(seen[step], step)):
                seen.append(ids)
        else:
            for step in range(MAX_QUEUED_STEPS):
                seen.append(model.forward_sampled(batch, cache, rows_after(seen[-1], step)))
                batch = batch.next_decode_step(seen[-1])
        picks[mode] = np.stack(seen[1:])  # (MAX_QUEUED_STEPS, 3)
    np.testing.assert_array_equal(picks["queued"], picks["one by one"])
    masked = np.concatenate([first[:1], picks["queued"][:, 0]])
    assert (masked[1:] % 2 != masked[:-1] % 2).all()


@pytest.mark.gpu
def test_forward_sampled_picks_what_the_host_sampler_picks_from_the_logits() -> None:
    """Three prompts in one prefill pass: the tokens forward_sampled draws on the device equal
    the host Sampler's rules (truncation.choose) applied to forward's logits of the same pass,
    for the same u (a u within 1e-4 of a cumulative boundary may round either way: skipped)."""
    from sparkinfer_cli.engine.truncation import choose, thread_workspace, truncate

    model = _tiny("qwen3", "Q8_0", exact=False)
    prompt = _goldens("qwen3")["prompt_long"]
    prompts = [prompt[:20], prompt[30:37], prompt[50:83]]
    rows = SamplingRows.of([DeviceDraw(0.8, 20, 0.9, 0.0, 0.3), DeviceDraw(1.2, 64, 1.0, 0.05, 0.7),
                            DeviceDraw(0.6, 7, 0.5, 0.1, 0.95)])
    picks = {}
    for mode in ("logits", "sampled"):
        cache = model.create_cache(12, BLOCK_SIZE, 3)
        batch = SequenceBatch(np.concatenate(prompts), [0] * 3, [len(p) for p in prompts],
                              [np.arange(i * 4, i * 4 + 4) for i in range(3)], [0, 1, 2])
        picks[mode] = model.forward(batch, cache) if mode == "logits" else \
            model.forward_sampled(batch, cache, rows)
    compared = 0
    for logits, (t, k, p, m, u), got in zip(picks["logits"], rows, picks["sampled"]):
        ws = thread_workspace(len(logits))
        kept = logits[truncate(logits, int(k), p, m, ws)]
        weights = np.exp((kept - kept.max()) / t).astype(np.float64)
        if np.abs(np.cumsum(weights) / weights.sum() - u).min() > 1e-4:
            assert got == choose(logits, t, int(k), p, m, u, ws)
            compared += 1
    assert compared >= 2


def _three_prefilled_sequences(model, family: str) -> tuple[object, SequenceBatch]:
    """A new cache holding three prompts of the family's golden text (3 state slots, 4 blocks
    each), and the decode batch that feeds each the prompt's own next token: not the model's
    pick, so that a pass fed its placeholder or the previous input instead of the previous
    pass's ids shows even where a tiny model repeats itself."""
    prompt = _goldens(family)["prompt_long"]
    prompts, tables = [prompt[:20], prompt[30:37], prompt[50:83]], [np.arange(i * 4, i * 4 + 4)
                                                                     for i in range(3)]
    cache = model.create_cache(12, BLOCK_SIZE, 3)
    for i, (p, t) in enumerate(zip(prompts, tables)):
        model.forward_greedy(SequenceBatch.single(p, 0, t, i), cache)
    first = np.array([prompt[20], prompt[37], prompt[83]], np.int32)
    return cache, SequenceBatch(first, [len(p) for p in prompts], [1] * 3, tables, [0, 1, 2])


def _greedy_steps(model, batch: SequenceBatch, cache, n_steps: int) -> list[np.ndarray]:
    """forward_greedy n_steps times, the host feeding each step's ids to the next."""
    steps = []
    for _ in range(n_steps):
        steps.append(model.forward_greedy(batch, cache))
        batch = batch.next_decode_step(steps[-1])
    return steps


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
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

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
@pytest.mark.parametrize("family", ("qwen3", "qwen35moe"))
@pytest.mark.parametrize("n_tokens", (300, 700))
def test_prefill_of_padded_buckets_matches_cpu(family: str, n_tokens: int) -> None:
    """Prompts of 300 and 700 tokens (buckets of 512 and 1,024 rows, 212 and 324 of them
    padding; dense linears and experts on tensor cores): every logit row as the CPU model's."""
    _assert_prefill_matches_cpu(family, n_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", (300, 700))
def test_chunked_gated_delta_prefill_matches_cpu(n_tokens: int, monkeypatch) -> None:
    """SPARKINFER_GDN_CHUNKED: the hybrid model's prefill through the chunked Gated DeltaNet
    kernels (many chunks, a partial last one, padded rows; f16 operands) gives the CPU model's
    top-1 wherever its margin is clear, and every logit within 1 % of the largest. The prompt
    repeats, so keys repeat within chunks: with β V as one f16 plane, its rounding reached the
    states and flipped the tiny router's choices (logits off by 9 % of the largest)."""
    monkeypatch.setenv("SPARKINFER_GDN_CHUNKED", "1")
    cpu, gpu = _prefills("qwen35moe", n_tokens)
    clear = _top1_margin(cpu) > NATIVE_MARGIN
    assert (gpu.argmax(1) == cpu.argmax(1))[clear].all()
    assert np.abs(gpu - cpu).max() <= 0.01 * np.abs(cpu).max()


def _assert_prefill_matches_cpu(family: str, n_tokens: int) -> None:
    cpu, gpu = _prefills(family, n_tokens)
    assert np.abs(gpu - cpu).max() <= DEQF32_TOL


def _prefills(family: str, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Every logit row of an n_tokens prompt on the CPU model and the exact GPU model."""
    path = TINY / family / f"{family}-Q8_0.gguf"
    ids = np.resize(_goldens(family)["prompt_long"], n_tokens).astype(np.int32)
    return _prefill(load_model(path), ids), _prefill(_gpu_model(path, True), ids)


@pytest.mark.gpu
def test_qwen35moe_prefill_and_decode_match_cpu() -> None:
    """A short hybrid MoE pass against the CPU model (too slow for the simulator in CI)."""
    path = TINY / "qwen35moe" / "qwen35moe-Q8_0.gguf"
    ids = _goldens("qwen35moe")["prompt_short"][:4]
    cpu = _prefill_then_decode(load_model(path), ids)
    gpu = _prefill_then_decode(_gpu_model(path, True), ids)
    assert np.abs(gpu - cpu).max() <= DEQF32_TOL


# ---- the kernels this model added, at tiny shapes (CI runs these in numba's simulator) -----------
def test_conv_silu_seq_runs_each_sequence_over_its_rows() -> None:
    from numba import cuda

    from sparkinfer_cli.kernels.cuda import gated_delta as gd

    rng = np.random.default_rng(1)
    mixed = rng.standard_normal((5, 6)).astype(np.float32)  # rows: seq 0 = 0..2, seq 1 = 3..4
    conv_w = rng.standard_normal((6, 4)).astype(np.float32)
    state = rng.standard_normal((3, 6, 3)).astype(np.float32)  # (slots, conv_dim, K-1)
    slots, lo, n = (np.array(v, np.int32) for v in ([2, 0, 1], [0, 3, 0], [3, 2, 0]))
    dev_state, out = cuda.to_device(state), cuda.device_array((5, 6), np.float32)
    gd.conv_silu_seq(cuda.to_device(mixed), cuda.to_device(conv_w), dev_state,
                     *(cuda.to_device(v) for v in (slots, lo, n)), out)
    expect, new_state = np.zeros((5, 6)), state.astype(np.float64).copy()
    for s in range(2):
        hist = new_state[slots[s]]  # (6, 3)
        for r in range(lo[s], lo[s] + n[s]):
            window = np.concatenate([hist, mixed[r][:, None]], axis=1)  # (6, 4)
            pre = (window * conv_w).sum(axis=1)
            expect[r] = pre / (1 + np.exp(-pre))
            hist = window[:, 1:]
        new_state[slots[s]] = hist
    np.testing.assert_allclose(out.copy_to_host(), expect, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dev_state.copy_to_host(), new_state, rtol=1e-6)  # slot 1 untouched


def test_delta_rule_seq_equals_reference_steps() -> None:
    from numba import cuda

    from sparkinfer_cli.kernels.cuda import gated_delta as gd
    from sparkinfer_cli.kernels.delta_rule_reference import fused_step

    rng = np.random.default_rng(2)
    n_k, n_v, dk, dv, rows = 1, 2, 32, 4, 3  # seq 0 = rows 0..1 in slot 1, seq 1 = row 2 in slot 0
    u = rng.standard_normal((rows, 2 * n_k * dk + n_v * dv)).astype(np.float32)
    a, b = (rng.standard_normal((rows, n_v)).astype(np.float32) for _ in range(2))
    ssm_a = -rng.uniform(0.5, 2, n_v).astype(np.float32)
    dt = rng.standard_normal(n_v).astype(np.float32)
    state = (rng.standard_normal((2, n_v, dv, dk)) * 0.1).astype(np.float32)
    slots, lo, n = (np.array(v, np.int32) for v in ([1, 0], [0, 2], [2, 1]))
    dev_state, out = cuda.to_device(state), cuda.device_array((rows, n_v, dv), np.float32)
    gd.delta_rule_seq(*(cuda.to_device(x) for x in (u, a, b, ssm_a, dt)), dev_state,
                      *(cuda.to_device(x) for x in (slots, lo, n)), out, n_k_heads=n_k,
                      head_map_mod=True, eps=1e-6)
    expect, new_state = np.zeros((rows, n_v, dv)), state.astype(np.float64).copy()
    for s in range(2):
        for r in range(lo[s], lo[s] + n[s]):
            o, st = fused_step(u[r:r + 1], a[r:r + 1], b[r:r + 1], ssm_a, dt,
                                                 new_state[slots[s]][None], n_k, True, 1e-6)
            expect[r], new_state[slots[s]] = o[0], st[0]
    np.testing.assert_allclose(out.copy_to_host(), expect, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dev_state.copy_to_host(), new_state, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_prefill_rows_attend_causally_through_row_seq() -> None:
    """T query rows of a sequence share its block table (row_seq), each sees positions ≤ its own."""
    from numba import cuda

    from sparkinfer_cli.kernels.cpu import ops
    from sparkinfer_cli.kernels.cuda import attention
    from tests.kernels.test_cuda_attention import paged_cache

    rng = np.random.default_rng(4)
    T, H, H_kv, D, bs = 5, 2, 1, 32, 2
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((T, H_kv, D)).astype(np.float32) for _ in range(2))
    table = np.array([[3, 0, 2], [1, 1, 1]], np.int32)  # row 1: another sequence, unused
    pos = np.arange(T)
    slot_mapping = (table[0][pos // bs] * bs + pos % bs).astype(np.int32)
    caches = [cuda.to_device(paged_cache(x, slot_mapping, 4, bs, np.float32)) for x in (k, v)]
    out = cuda.device_array((T, H, D), np.float32)
    ws = attention.DecodeWorkspace(T, H, D, 8, split_len=4)
    attention.paged_decode_attention(cuda.to_device(q), *caches, cuda.to_device(table),
                                     cuda.to_device((pos + 1).astype(np.int32)), out, ws,
                                     row_seq=cuda.to_device(np.zeros(T, np.int32)))
    np.testing.assert_allclose(out.copy_to_host(), ops.causal_attention(q, k, v, 0),
                               rtol=1e-4, atol=1e-5)


def test_gather_rows() -> None:
    from numba import cuda

    from sparkinfer_cli.kernels.cuda.model_ops import gather_rows

    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    out = cuda.device_array((2, 3), np.float32)
    gather_rows(cuda.to_device(x), cuda.to_device(np.array([3, 1], np.int32)), out)
    np.testing.assert_array_equal(out.copy_to_host(), x[[3, 1]])


def test_decode_greedy_refuses_what_it_cannot_queue() -> None:
    """Checked before anything is queued (so the simulator runs no pass): a prefill piece, more
    passes than there are staging rows, block tables too short for the passes. The tiny model's
    Q8_0 token table is read on the device."""
    from sparkinfer_cli.backend.cuda.workspace import MAX_QUEUED_STEPS

    model = _tiny("qwen3", "Q8_0", exact=False)
    assert model.token_embd is not None and model.token_embd.n_rows == model.config.n_vocab
    cache = model.create_cache(2, BLOCK_SIZE, 1)
    one = SequenceBatch.single([3], 10, [0])  # position 10 of a 16-token block
    with pytest.raises(ValueError, match="one new token a sequence"):
        model.decode_greedy(SequenceBatch.single([3, 4], 10, [0]), cache, 2)
    with pytest.raises(ValueError, match=f"1 to {MAX_QUEUED_STEPS} steps"):
        model.decode_greedy(one, cache, MAX_QUEUED_STEPS + 1)
    with pytest.raises(ValueError, match="does not cover 17 tokens"):
        model.decode_greedy(one, cache, 7)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("qwen3", "qwen35moe"))
def test_engine_outputs_of_concurrent_requests_equal_their_solo_outputs(family: str) -> None:
    """24 greedy requests submitted together through the engine (batched policy: prompts prefill
    together and mix with decodes in graph-replayed passes captured before serving) produce the
    tokens each produces alone."""
    from sparkinfer_cli.engine.engine import ContinuousBatchEngine, EngineConfig
    from sparkinfer_cli.engine.sampling_params import SamplingParams
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

    path = TINY / family / f"{family}-Q8_0.gguf"
    model = _gpu_model(path, True)
    engine = ContinuousBatchEngine(model, Tokenizer.from_gguf(GGUFFile(path)),
                                   EngineConfig(ctx=8192, block_size=BLOCK_SIZE, max_num_seqs=32,
                                                step_tokens=384))
    text = [int(t) for t in _goldens(family)["prompt_long"]] * 3  # 300 tokens
    prompts = [text[i % 7:i % 7 + 2 + 12 * i] for i in range(24)]  # 2 to 278 tokens
    _check_together_as_alone(engine, prompts,
                             SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))


def _check_together_as_alone(engine, prompts: list[list[int]], params) -> None:
    """Starts the engine: each prompt's tokens alone, then all submitted together, are the
    same."""
    engine.start()
    try:
        solo = [_engine_tokens(engine, [p], params)[0] for p in prompts]
        assert _engine_tokens(engine, prompts, params) == solo
    finally:
        engine.shutdown()


def _engine_tokens(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """The output tokens of prompts submitted together, in order."""
    sink = _Sink()
    return sink.tokens([engine.submit(p, params, sink.on_event) for p in prompts])


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("qwen3", "qwen35moe"))
def test_engine_answers_the_same_with_the_prefix_cache_on_and_off(family: str) -> None:
    """On the device (graphs, device-side state snapshots and block copies): a conversation's
    next turn, a prompt parting from it mid-block and a repeat give the tokens an engine
    without the cache gives."""
    from sparkinfer_cli.engine.engine import ContinuousBatchEngine, EngineConfig
    from sparkinfer_cli.engine.sampling_params import SamplingParams
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

    path = TINY / family / f"{family}-Q8_0.gguf"
    model, tokenizer = _gpu_model(path, True), Tokenizer.from_gguf(GGUFFile(path))
    engines = [ContinuousBatchEngine(model, tokenizer, EngineConfig(
        ctx=4096, block_size=BLOCK_SIZE, max_num_seqs=8, prefix_cache=on,
        prefix_snapshot_tokens=64)) for on in (True, False)]
    text = [int(t) for t in _goldens(family)["prompt_long"]] * 3  # 300 tokens
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for engine in engines:
        engine.start()
    try:
        first = text[:150]
        answers = [_engine_tokens(engine, [first], params)[0] for engine in engines]
        turns = [[*first, *answers[1], *text[150:180]], [*text[:75], *text[200:230]], first]
        for prompt in turns:
            on, off = (_engine_tokens(engine, [prompt], params)[0] for engine in engines)
            assert on == off
        assert engines[0].kv.num_hit_tokens > 0 and engines[1].kv.num_hit_tokens == 0
    finally:
        for engine in engines:
            engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("source", ("ngram", "draft"))
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_answers_the_same_with_drafts(family: str, source: str) -> None:
    """Quantized mode, as the server runs: greedy tokens with drafts equal those without, for
    each prompt alone and for 6 given to an engine before its first step (so that both engines
    prefill them in the same pass: a MoE prefill's experts switch kernels with the pass size).
    Drafts come from n-gram lookup (the prompts repeat themselves, and so do the answers of the
    families other than the hybrid MoEs: there drafts are kept) or from a draft model on the
    device: the family's own file where it has attention layers only (so drafts are kept), else
    the tiny qwen3's. A hybrid model's state goes back to its copy after a rejected draft.
    Drafts are checked in passes of up to DRAFT_PASS_TOKENS rows computed as decodes."""
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

    path = TINY / family / f"{family}-Q8_0.gguf"
    model, tokenizer = _gpu_model(path, False), Tokenizer.from_gguf(GGUFFile(path))
    drafts_itself = family in ("qwen3", "qwen3moe")
    draft = None if source == "ngram" else _gpu_model(
        path if drafts_itself else TINY / "qwen3" / "qwen3-Q8_0.gguf", False)
    text = [int(t) for t in _goldens(family)["prompt_long"]]
    answers, kept = answers_with_and_without_drafts(model, tokenizer, text,
                                                    draft_model=draft)
    assert answers[4, False] == answers[0, False], "alone"
    assert answers[4, True] == answers[0, True], "together"
    repeats = family in ("qwen3", "qwen3moe", "qwen35")  # its answers repeat their prompts
    assert kept > 0 or not (repeats if source == "ngram" else drafts_itself)


def answers_with_and_without_drafts(model, tokenizer, text: list[int], **drafts):
    """({(spec tokens 4 | 0, together): greedy answers}, drafts kept) of 6 prompts of text's
    tokens (36 each, a 9-token period), alone and given to an engine before its first step;
    drafts: the engine's draft source (draft_model= or use_mtp=True; none: n-gram lookup)."""
    from sparkinfer_cli.engine.engine import ContinuousBatchEngine, EngineConfig
    from sparkinfer_cli.engine.sampling_params import SamplingParams

    prompts = [text[i:i + 9] * 4 for i in range(0, 60, 10)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    answers, kept = {}, 0
    for spec_tokens in (4, 0):
        config = EngineConfig(ctx=4096, block_size=BLOCK_SIZE, max_num_seqs=8,
                              prefix_cache=False, spec_tokens=spec_tokens)
        for together in (True, False):  # one engine at a time: they share the model's stream
            engine = ContinuousBatchEngine(model, tokenizer, config,
                                           **(drafts if spec_tokens else {}))
            sink = _Sink()
            ids = [engine.submit(p, params, sink.on_event) for p in prompts] if together else []
            engine.start()
            try:
                answers[spec_tokens, together] = sink.tokens(ids) if together else \
                    [_engine_tokens(engine, [p], params)[0] for p in prompts]
                kept += engine.speculation.num_accepted_tokens
            finally:
                engine.shutdown()
    return answers, kept


class _Sink:
    """Tokens of requests submitted before their engine started, by request id."""

    def __init__(self):
        import threading

        self._tokens: dict[str, list[int]] = {}
        self._done = threading.Semaphore(0)

    def on_event(self, event) -> None:
        self._tokens.setdefault(event.request_id, []).extend(event.token_ids)
        if event.finish_reason is not None:
            self._done.release()

    def tokens(self, ids: list[str]) -> list[list[int]]:
        for _ in ids:
            assert self._done.acquire(timeout=600)
        return [self._tokens[i] for i in ids]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("qwen3moe", "qwen35moe"))
def test_batch_invariant_mode_answers_under_load_as_alone(family: str, monkeypatch) -> None:
    """SPARKINFER_BATCH_INVARIANT, quantized mode as the server runs: 40 greedy requests
    submitted together (more than the GEMMs' 32 rows would take at once, prompts of 2 to 236
    tokens that arrive in pieces) produce, token for token, what each produces alone."""
    from sparkinfer_cli.engine.engine import ContinuousBatchEngine, EngineConfig
    from sparkinfer_cli.engine.sampling_params import SamplingParams
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

    monkeypatch.setenv("SPARKINFER_BATCH_INVARIANT", "1")
    path = TINY / family / f"{family}-Q8_0.gguf"
    model = _gpu_model.__wrapped__(path, False)
    engine = ContinuousBatchEngine(model, Tokenizer.from_gguf(GGUFFile(path)), EngineConfig(
        ctx=8192, block_size=BLOCK_SIZE, max_num_seqs=48, prefix_cache=False))
    text = [int(t) for t in _goldens(family)["prompt_long"]] * 3  # 300 tokens
    prompts = [text[i % 7:i % 7 + 2 + 6 * i] for i in range(40)]
    _check_together_as_alone(engine, prompts,
                             SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
