"""The tensors every file of an architecture must hold, checked against ModelConfig before any
weight is read: a file whose tensor table does not match its metadata is refused up front, with
the tensor named, instead of failing part-way through loading (or not at all)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from sparkinfer_cli.model.weights import expect_shape

if TYPE_CHECKING:
    from sparkinfer_cli.gguf.reader import GGUFFile
    from sparkinfer_cli.model.config import ModelConfig

Shape = tuple[int, ...]


def check_required_tensors(gguf: GGUFFile, config: ModelConfig) -> None:
    """GGUFError naming the first required tensor that is missing or misshaped."""
    for name, shape in required_tensors(config):
        expect_shape(gguf, name, shape)


def required_tensors(c: ModelConfig) -> Iterator[tuple[str, Shape]]:
    """(name, ggml shape) of the embedding, the final norm and each layer's norm, mixer output
    and FFN down projection: what every supported architecture reads (the loader checks the rest
    exhaustively)."""
    E, q_dim, kv_dim = c.n_embd, c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    yield "token_embd.weight", (E, c.n_vocab)
    yield "output_norm.weight", (E,)
    for i in range(c.n_layer):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (E,)
        if c.is_recurrent(i):
            yield p + "ssm_out.weight", (c.ssm_inner_size, E)
        else:
            yield p + "attn_k.weight", (E, kv_dim)
            yield p + "attn_v.weight", (E, kv_dim)
            yield p + "attn_output.weight", (q_dim, E)
        if c.is_moe:
            yield p + "ffn_gate_inp.weight", (E, c.n_expert)
        else:
            yield p + "ffn_down.weight", (c.n_ff, E)
