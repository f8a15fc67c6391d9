"""Files we write load and run: every tiny synthetic preset, and the oracle fixtures rewritten into
the other layouts llama.cpp accepts (legacy fused ssm_in, fused ffn_gate_up_exps, an MTP block).

- synthetic presets: finite logits; prefill, chunked prefill and decode give the one-pass logits;
  several sequences in one batch (own blocks and state slots) give what each gives alone;
- rewritten fixtures still match llama.cpp's deqf32 logits of the original file;
- a tensor type the engine cannot compute with is refused at load, naming the tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from sparkinfer_cli.gguf.reader import GGUFError, GGUFFile
from sparkinfer_cli.gguf.synthetic import PRESETS, write_synthetic
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import load_model

TINY = Path(__file__).parent.parent / "fixtures" / "tiny"
TINY_PRESETS = sorted(name for name in PRESETS if name.startswith("tiny-"))
BLOCK_SIZE = 4
SAME_TOL = 1e-4  # one computation split differently: float32 summation order only
ORACLE_TOL = 1e-3

Tensors = dict[str, tuple[np.ndarray, int]]  # name → (raw data as gguf reads it, ggml type)


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], object]:
    folder, models = tmp_path_factory.mktemp("synthetic"), {}

    def get(preset: str):
        if preset not in models:
            models[preset] = load_model(write_synthetic(folder / f"{preset}.gguf", preset, seed=3))
        return models[preset]

    return get


def _tokens(n: int, seed: int, n_vocab: int = 512) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)  # (n,)


def _run(model, cache, ids: np.ndarray, start: int, table: np.ndarray, slot: int) -> np.ndarray:
    batch = SequenceBatch.single(ids, start, table, slot, all_logits=True)
    return model.forward(batch, cache)  # (len(ids), n_vocab)


def _alone(model, ids: np.ndarray) -> np.ndarray:
    cache = model.create_cache(-(-len(ids) // BLOCK_SIZE), BLOCK_SIZE, 1)
    return _run(model, cache, ids, 0, np.arange(cache.num_blocks), 0)


# ---- synthetic presets -------------------------------------------------------------------------

@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_prefill_chunks_and_decode_equal_one_pass(synthetic_model, preset: str) -> None:
    model = synthetic_model(preset)
    ids = _tokens(13, seed=1)
    one_pass = _alone(model, ids)  # (13, V)
    assert np.isfinite(one_pass).all(), f"{preset}: non-finite logits"
    cache = model.create_cache(8, BLOCK_SIZE, 2)
    table = np.array([6, 2, 7, 0], dtype=np.int32)  # scattered blocks
    pieces, start = [], 0
    for n in (5, 3, 1, 1, 1, 1, 1):  # prefill, a chunk that starts mid-sequence, then decode steps
        pieces.append(_run(model, cache, ids[start:start + n], start, table, slot=1))
        start += n
    delta = float(np.abs(np.concatenate(pieces) - one_pass).max())
    assert delta <= SAME_TOL, f"{preset}: chunked/decode vs one pass max |Δ| = {delta:.3g}"


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_batched_sequences_equal_each_alone(synthetic_model, preset: str) -> None:
    model = synthetic_model(preset)
    seqs = [_tokens(n, seed=10 + n) for n in (9, 4, 14)]
    alone = [_alone(model, s) for s in seqs]
    cache = model.create_cache(16, BLOCK_SIZE, 3)
    _fill_with_garbage(cache)  # a new sequence must not see what its slot or blocks held
    tables = [np.array(t, dtype=np.int32) for t in ([3, 9, 1], [12, 0], [5, 15, 2, 8])]
    slots = [2, 0, 1]
    first = [6, 4, 11]  # tokens in the first pass; the rest come in a second, mixed pass
    got = _two_mixed_passes(model, cache, seqs, tables, slots, first)
    for i, (ours, ref) in enumerate(zip(got, alone)):
        delta = float(np.abs(ours - ref).max())
        assert delta <= SAME_TOL, f"{preset}: sequence {i} batched vs alone max |Δ| = {delta:.3g}"


def _two_mixed_passes(model, cache, seqs, tables, slots, first) -> list[np.ndarray]:
    """Pass 1 prefills a prefix of every sequence; pass 2 continues them (decode or chunk)."""
    rows: list[list[np.ndarray]] = [[] for _ in seqs]
    for lo_of, hi_of in ((lambda i: 0, lambda i: first[i]), (lambda i: first[i], lambda i: None)):
        parts = [s[lo_of(i):hi_of(i)] for i, s in enumerate(seqs)]
        batch = SequenceBatch(np.concatenate(parts), [lo_of(i) for i in range(len(seqs))],
                              [len(p) for p in parts], tables, slots, all_logits=True)
        logits = model.forward(batch, cache)  # (Σ len(parts), V)
        for i, chunk in enumerate(np.split(logits, np.cumsum([len(p) for p in parts])[:-1])):
            rows[i].append(chunk)
    return [np.concatenate(r) for r in rows]


def _fill_with_garbage(cache) -> None:
    rng = np.random.default_rng(0)
    for a in (cache.k, cache.v, cache.conv_state, cache.delta_state):
        a[...] = rng.standard_normal(a.shape)


# ---- rewritten files ---------------------------------------------------------------------------

def rewrite_gguf(src: Path, dst: Path, edit: Callable[[Tensors], Tensors],
                 metadata: dict[str, tuple] | None = None) -> Path:
    """Copy a GGUF with gguf's own reader/writer, with tensors edited and metadata overridden
    (key → (value, value type[, array element type]))."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value, *types = (metadata or {}).get(field.name, (field.contents(), *field.types[:2]))
        writer.add_key_value(field.name, value, *types)
    for key, (value, *types) in (metadata or {}).items():
        if key not in reader.fields:
            writer.add_key_value(key, value, *types)
    tensors = {t.name: (np.asarray(t.data), int(t.tensor_type)) for t in reader.tensors}
    for name, (data, ggml_type) in edit(tensors).items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _assert_matches_deqf32(path: Path, family: str, variant: str) -> None:
    with np.load(TINY / family / f"{family}.goldens.npz") as g:
        ids, ref = g["prompt_short"], g[f"lc_{variant}_deqf32_logits_short"]
    delta = float(np.abs(_alone(load_model(path), ids) - ref).max())
    assert delta <= ORACLE_TOL, f"{path.name}: max |Δlogit| = {delta:.3g} vs llama.cpp deqf32"


def _to_legacy_ssm_in(tensors: Tensors, H_k: int, d: int) -> Tensors:
    """attn_qkv + attn_gate → ssm_in with rows per k-head group g: [q_g | k_g | v_g | z_g]."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("attn_qkv.weight")]:
        prefix = name[:-len("attn_qkv.weight")]
        (qkv, t), (z, _) = out.pop(name), out.pop(prefix + "attn_gate.weight")
        q, k, v = np.split(qkv, [H_k * d, 2 * H_k * d])  # rows
        groups = [np.concatenate([x.reshape(H_k, -1, x.shape[-1])[g] for x in (q, k, v, z)])
                  for g in range(H_k)]
        out[prefix + "ssm_in.weight"] = (np.concatenate(groups), t)
    return out


def test_legacy_fused_ssm_in_matches_llama_cpp(tmp_path: Path) -> None:
    src = TINY / "qwen3next" / "qwen3next-Q8_0.gguf"
    path = rewrite_gguf(src, tmp_path / "legacy.gguf", lambda t: _to_legacy_ssm_in(t, 2, 64))
    assert "blk.0.ssm_in.weight" in GGUFFile(path).tensors
    _assert_matches_deqf32(path, "qwen3next", "Q8_0")


def _fuse_gate_up_exps(tensors: Tensors) -> Tensors:
    """ffn_gate_exps + ffn_up_exps → ffn_gate_up_exps (per expert: gate rows, then up rows)."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("ffn_gate_exps.weight")]:
        prefix = name[:-len("ffn_gate_exps.weight")]
        (gate, t), (up, _) = out.pop(name), out.pop(prefix + "ffn_up_exps.weight")
        out[prefix + "ffn_gate_up_exps.weight"] = (np.concatenate([gate, up], axis=1), t)
    return out


@pytest.mark.parametrize("family", ["qwen3moe", "qwen35moe"])
def test_fused_gate_up_experts_match_llama_cpp(tmp_path: Path, family: str) -> None:
    src = TINY / family / f"{family}-Q4_K_M.gguf"
    path = rewrite_gguf(src, tmp_path / "fused.gguf", _fuse_gate_up_exps)
    _assert_matches_deqf32(path, family, "Q4_K_M")


def _with_mtp_block(tensors: Tensors, n_layer: int) -> Tensors:
    """Append a NextN/MTP block at blk.{n_layer}: a copy of the last layer plus nextn tensors."""
    out = dict(tensors)
    last = f"blk.{n_layer - 1}."
    for name, value in tensors.items():
        if name.startswith(last):
            out[f"blk.{n_layer}." + name[len(last):]] = value
    n_embd = tensors["output_norm.weight"][0].shape[-1]
    out[f"blk.{n_layer}.nextn.eh_proj.weight"] = (np.zeros((n_embd, 2 * n_embd), np.float32), 0)
    out[f"blk.{n_layer}.nextn.enorm.weight"] = (np.ones(n_embd, np.float32), 0)
    return out


def test_mtp_block_is_skipped(tmp_path: Path) -> None:
    V = gguf.GGUFValueType
    layers = [True, True, True, False, False]  # the MTP layer is never recurrent
    metadata = {"qwen35moe.block_count": (5, V.UINT32),
                "qwen35moe.nextn_predict_layers": (1, V.UINT32),
                "qwen35moe.attention.recurrent_layers": (layers, V.ARRAY, V.BOOL)}
    path = rewrite_gguf(TINY / "qwen35moe" / "qwen35moe-Q8_0.gguf", tmp_path / "mtp.gguf",
                        lambda t: _with_mtp_block(t, 4), metadata)
    assert load_model(path).config.n_layer == 4
    _assert_matches_deqf32(path, "qwen35moe", "Q8_0")


def test_unsupported_tensor_type_is_refused_at_load(tmp_path: Path) -> None:
    src = write_synthetic(tmp_path / "src.gguf", "tiny-qwen35moe", seed=1)
    name = "blk.0.attn_gate.weight"

    def to_q2_k(tensors: Tensors) -> Tensors:
        rows = tensors[name][0].shape[0]
        q2_k = np.ones((rows, 84), np.uint8)  # (rows, Q2_K row bytes for ne0 = 256)
        return {**tensors, name: (q2_k, int(gguf.GGMLQuantizationType.Q2_K))}

    path = rewrite_gguf(src, tmp_path / "q2k.gguf", to_q2_k)
    with pytest.raises(GGUFError, match=rf"{name}.*Q2_K"):
        load_model(path)
