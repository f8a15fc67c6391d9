"""The MTP (NextN) head of Qwen3.5 / Qwen3.6 files (model/mtp.py) against an independent float64
reference of the published architecture, on synthetic tiny files with one NextN block: read with
the gguf package's own reader and dequantizer, computed as vLLM's Qwen3-Next / Qwen3.5 MTP module
and llama.cpp's qwen35 graph describe it (shared/docs/ARCHITECTURES.md §4.4, the NextN block):

    x = eh_proj([RMSNorm(embed(t_p), enorm) | RMSNorm(h_{p-1}, hnorm)])   (h_{-1} = 0)
    x += o_proj(attention(RMSNorm(x, attn_norm)) ⊙ sigmoid(gate))        (causal, the head's KV)
    x += FFN(RMSNorm(x, post_attention_norm))                  (routed MoE + gated shared expert)
    logits = output(RMSNorm(x, shared_head_norm))

Every row of a prompt's pairs, then a draft step that feeds the head its own state and argmax
token at the next position (so the head's KV of the prompt is read back)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from sparkinfer_cli.gguf.synthetic import write_synthetic
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import load_model

BLOCK = 16


class Reference:
    """The head in float64 from the file's tensors (gguf-py, not this project's reader)."""

    def __init__(self, path: Path):
        reader = GGUFReader(path)
        self.t = {t.name: t for t in reader.tensors}
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        field = lambda key: reader.fields[f"{arch}.{key}"].parts[-1][0]  # noqa: E731
        self.layer = int(field("block_count")) - int(field("nextn_predict_layers"))
        self.n_head, self.n_kv = int(field("attention.head_count")), \
            int(field("attention.head_count_kv"))
        self.hd, self.n_rot = int(field("attention.key_length")), int(field("rope.dimension_count"))
        self.base, self.eps = float(field("rope.freq_base")), \
            float(field("attention.layer_norm_rms_epsilon"))
        self.k = int(field("expert_used_count")) if f"{arch}.expert_used_count" in \
            reader.fields else 0

    def w(self, name: str) -> np.ndarray:
        t = self.t[name]
        return dequantize(t.data, t.tensor_type).astype(np.float64)

    def b(self, name: str) -> np.ndarray:
        return self.w(f"blk.{self.layer}.{name}.weight")

    def rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def logits(self, tokens: list[int], hidden: np.ndarray) -> np.ndarray:
        """(n, V): row p predicts the token at p + 2 from token p and hidden row p."""
        embedded = self.w("token_embd.weight")[tokens]
        x = np.concatenate([self.rms(embedded, self.b("nextn.enorm")),
                            self.rms(hidden, self.b("nextn.hnorm"))], axis=1)
        x = x @ self.b("nextn.eh_proj").T
        x = x + self.attention(self.rms(x, self.b("attn_norm")))
        x = x + self.ffn(self.rms(x, self.b("post_attention_norm")))
        head_norm = "nextn.shared_head_norm"
        norm = self.b(head_norm) if f"blk.{self.layer}.{head_norm}.weight" in self.t else \
            self.w("output_norm.weight")
        output = self.w("output.weight" if "output.weight" in self.t else "token_embd.weight")
        return self.rms(x, norm) @ output.T

    def attention(self, x: np.ndarray) -> np.ndarray:
        n, nh, hd = len(x), self.n_head, self.hd
        qg = (x @ self.b("attn_q").T).reshape(n, nh, 2 * hd)  # per head: query | gate
        q, gate = qg[..., :hd], qg[..., hd:]
        k = (x @ self.b("attn_k").T).reshape(n, self.n_kv, hd)
        v = (x @ self.b("attn_v").T).reshape(n, self.n_kv, hd)
        q, k = self.rope(self.rms(q, self.b("attn_q_norm"))), \
            self.rope(self.rms(k, self.b("attn_k_norm")))
        k, v = (np.repeat(a, nh // self.n_kv, axis=1) for a in (k, v))  # GQA: head h → h / r
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        scores += np.triu(np.full((n, n), -np.inf), 1)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", probs, v) / (1 + np.exp(-gate))
        return out.reshape(n, nh * hd) @ self.b("attn_output").T

    def rope(self, x: np.ndarray) -> np.ndarray:
        """NEOX pairs (i, i + n_rot/2) over the first n_rot dims at positions 0 .. n − 1 (IMROPE
        with text positions (p, p, p, 0) is this)."""
        half = self.n_rot // 2
        angle = np.arange(len(x))[:, None] * self.base ** (-np.arange(half) * 2 / self.n_rot)
        cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
        lo, hi = x[..., :half], x[..., half:self.n_rot]
        return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin, x[..., self.n_rot:]],
                              axis=-1)

    def ffn(self, x: np.ndarray) -> np.ndarray:
        if f"blk.{self.layer}.ffn_gate_inp.weight" not in self.t:
            return swiglu(x, self.b("ffn_gate"), self.b("ffn_up"), self.b("ffn_down"))
        p = np.exp(x @ self.b("ffn_gate_inp").T)
        p /= p.sum(axis=1, keepdims=True)
        gate, up, down = self.b("ffn_gate_exps"), self.b("ffn_up_exps"), self.b("ffn_down_exps")
        out = np.zeros_like(x)
        for row, probs in enumerate(p):
            picked = np.argsort(-probs, kind="stable")[:self.k]
            for e in picked:
                out[row] += probs[e] / probs[picked].sum() * \
                    swiglu(x[row:row + 1], gate[e], up[e], down[e])[0]
        shared_gate = 1 / (1 + np.exp(-(x @ self.b("ffn_gate_inp_shexp"))))
        return out + shared_gate[:, None] * swiglu(x, self.b("ffn_gate_shexp"),
                                                   self.b("ffn_up_shexp"),
                                                   self.b("ffn_down_shexp"))


def swiglu(x, gate, up, down):
    g = x @ gate.T
    return (g / (1 + np.exp(-g)) * (x @ up.T)) @ down.T


@pytest.mark.parametrize("preset", ["tiny-qwen35moe-mtp", "tiny-qwen35-mtp"])
def test_head_matches_the_float64_reference(preset: str, tmp_path) -> None:
    path = write_synthetic(tmp_path / "m.gguf", preset, seed=11)
    model = load_model(path, "cpu", with_mtp=True)  # float32 throughout
    reference = Reference(path)
    tokens = [int(t) for t in np.random.default_rng(2).integers(3, 470, 21)]
    n, blocks = len(tokens), np.arange(2, dtype=np.int32)
    batch = SequenceBatch.single(np.asarray(tokens, np.int32), 0, blocks, 0)
    _, hidden = model.forward_hidden(batch, model.create_cache(2, BLOCK, 1))
    pairs = np.concatenate([np.zeros_like(hidden[:1]), hidden[:-1]])  # h_{p-1} beside t_p
    batch.all_logits = True
    head_cache = model.mtp.create_cache(2, BLOCK)
    logits, states = model.mtp.forward(pairs, batch, head_cache)
    expected = reference.logits(tokens, pairs.astype(np.float64))
    _assert_close(logits, expected)
    draft = int(np.argmax(logits[-1]))  # the next pair: the head's own state and pick
    step, _ = model.mtp.forward(states[-1:], SequenceBatch.single(
        np.array([draft], np.int32), n, blocks, 0), head_cache)
    expected = reference.logits(tokens + [draft], np.concatenate([pairs, states[-1:]]))
    _assert_close(step, expected[-1:])


def _assert_close(ours: np.ndarray, expected: np.ndarray) -> None:
    assert ours.shape == expected.shape
    scale = np.abs(expected).max()
    assert scale > 0.1  # a head whose logits vanish would match anything
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4 * scale)
