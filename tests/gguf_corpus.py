"""A tiny valid llama GGUF (written with gguf.GGUFWriter) and corrupted copies of it.

Each corruption is one function (valid file path, output path) → None; CORRUPTIONS names them.
Byte-level corruptions patch fields located by gguf's own reader, so they hit the intended field;
metadata-level ones rewrite the file through GGUFWriter with one key or tensor changed.
`reach` stands in for what a command does after loading, so a test sees how far it got.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from sparkinfer_cli.tokenizer.tokenizer import BYTE_TO_CHAR

V = gguf.GGUFValueType
ARCH = "llama"
N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, N_LAYER, CONTEXT = 64, 2, 1, 32, 128, 2, 256
MERGES = ["Ġ t", "h e"]
TOKENS = [BYTE_TO_CHAR[b] for b in range(256)] + ["Ġt", "he", "<|endoftext|>"]
Metadata = dict[str, tuple[Any, Any]]  # key → (value, GGUFValueType), None to leave it out


class Reached(Exception):
    """The command got past its checks: generation, the engine or the server would start now."""


def reach(*args: Any, **kwargs: Any) -> None:
    raise Reached(args, kwargs)


def base_metadata() -> Metadata:
    a = f"{ARCH}."
    return {
        "general.name": ("hostile-tiny", V.STRING),
        a + "block_count": (N_LAYER, V.UINT32),
        a + "context_length": (CONTEXT, V.UINT32),
        a + "embedding_length": (N_EMBD, V.UINT32),
        a + "feed_forward_length": (N_FF, V.UINT32),
        a + "attention.head_count": (N_HEAD, V.UINT32),
        a + "attention.head_count_kv": (N_HEAD_KV, V.UINT32),
        a + "attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32),
        a + "rope.freq_base": (10000.0, V.FLOAT32),
        "tokenizer.ggml.model": ("gpt2", V.STRING),
        "tokenizer.ggml.pre": ("smollm", V.STRING),
        "tokenizer.ggml.tokens": (TOKENS, V.ARRAY),
        "tokenizer.ggml.token_type": ([1] * 258 + [3], V.ARRAY),
        "tokenizer.ggml.merges": (MERGES, V.ARRAY),
        "tokenizer.ggml.eos_token_id": (len(TOKENS) - 1, V.UINT32),
    }


def base_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:  # numpy order: (rows, ne0)
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    tensors = {"token_embd.weight": rand(len(TOKENS), N_EMBD),
               "output_norm.weight": np.ones(N_EMBD, np.float32)}
    for i in range(N_LAYER):
        p = f"blk.{i}."
        tensors.update({
            p + "attn_norm.weight": np.ones(N_EMBD, np.float32),
            p + "attn_q.weight": rand(N_HEAD * HEAD_DIM, N_EMBD),
            p + "attn_k.weight": rand(N_HEAD_KV * HEAD_DIM, N_EMBD),
            p + "attn_v.weight": rand(N_HEAD_KV * HEAD_DIM, N_EMBD),
            p + "attn_output.weight": rand(N_EMBD, N_HEAD * HEAD_DIM),
            p + "ffn_norm.weight": np.ones(N_EMBD, np.float32),
            p + "ffn_gate.weight": rand(N_FF, N_EMBD),
            p + "ffn_up.weight": rand(N_FF, N_EMBD),
            p + "ffn_down.weight": rand(N_EMBD, N_FF),
        })
    return tensors


def write_tiny(path: Path, metadata: Metadata | None = None,
               tensors: dict[str, np.ndarray | None] | None = None) -> Path:
    """The tiny model with metadata / tensor overrides (a None value drops the entry)."""
    writer = gguf.GGUFWriter(path, ARCH)
    for key, entry in {**base_metadata(), **(metadata or {})}.items():
        if entry is not None:
            value, vtype = entry
            sub = _array_type(value) if vtype == V.ARRAY else None
            writer.add_key_value(key, value, vtype, sub_type=sub)
    for name, data in {**base_tensors(), **(tensors or {})}.items():
        if data is not None:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _array_type(value: list) -> Any:
    first = value[0] if value else ""
    return V.STRING if isinstance(first, str) else V.ARRAY if isinstance(first, list) \
        else V.FLOAT32 if isinstance(first, float) else V.INT32


# ---- byte-level access ---------------------------------------------------------------------------
def kv_value_offset(path: Path, key: str) -> int:
    """Byte offset of a KV's value type field (just after its key)."""
    return gguf.GGUFReader(path).fields[key].offset + 8 + len(key.encode())


def tensor_info_offset(path: Path, name: str) -> int:
    """Byte offset of a tensor info's n_dims field (just after its name)."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return tensor.field.offset + 8 + len(name.encode())


def tensor_offset_field(path: Path, name: str) -> int:
    """Byte offset of a tensor info's data offset field."""
    at = tensor_info_offset(path, name)
    n_dims = struct.unpack_from("<I", path.read_bytes(), at)[0]
    return at + 4 + 8 * n_dims + 4


def patch(src: Path, dst: Path, at: int, fmt: str, value: Any) -> None:
    data = bytearray(src.read_bytes())
    struct.pack_into("<" + fmt, data, at, value)
    dst.write_bytes(bytes(data))


def truncate(src: Path, dst: Path, size: int) -> None:
    dst.write_bytes(src.read_bytes()[:size])


Corruption = Callable[[Path, Path], None]
TOKENS_KEY, MERGES_KEY = "tokenizer.ggml.tokens", "tokenizer.ggml.merges"
FIRST_WEIGHT, SECOND_WEIGHT = "blk.0.ffn_up.weight", "blk.1.ffn_up.weight"


def _at_key(key: str, extra: int, fmt: str, value: Any) -> Corruption:
    return lambda src, dst: patch(src, dst, kv_value_offset(src, key) + extra, fmt, value)


def _at_tensor(name: str, extra: int, fmt: str, value: Any) -> Corruption:
    return lambda src, dst: patch(src, dst, tensor_info_offset(src, name) + extra, fmt, value)


def _offset_of(name: str, value: Callable[[int], int]) -> Corruption:
    def corrupt(src: Path, dst: Path) -> None:
        at = tensor_offset_field(src, name)
        old = struct.unpack_from("<Q", src.read_bytes(), at)[0]
        patch(src, dst, at, "Q", value(old))
    return corrupt


def _same_offset_as(name: str, other: str) -> Corruption:
    def corrupt(src: Path, dst: Path) -> None:
        other_offset = struct.unpack_from("<Q", src.read_bytes(),
                                          tensor_offset_field(src, other))[0]
        patch(src, dst, tensor_offset_field(src, name), "Q", other_offset)
    return corrupt


def _renamed(name: str, to: str) -> Corruption:
    def corrupt(src: Path, dst: Path) -> None:
        data = src.read_bytes()
        at = tensor_info_offset(src, name) - len(name)
        dst.write_bytes(data[:at] + to.encode() + data[at + len(to):])
    return corrupt


def _rewritten(metadata: Metadata | None = None,
               tensors: dict[str, np.ndarray | None] | None = None) -> Corruption:
    def corrupt(src: Path, dst: Path) -> None:
        write_tiny(dst, metadata, tensors)
    return corrupt


def _nested_arrays(depth: int) -> Corruption:
    """A KV whose value is an array of an array of … `depth` deep (each holding one element)."""
    def corrupt(src: Path, dst: Path) -> None:
        pad = 12 * depth + 5  # the placeholder's bytes after its length, = the nesting's
        write_tiny(dst, {"zz.placeholder": ("x" * pad, V.STRING)})
        at = kv_value_offset(dst, "zz.placeholder")
        nested = struct.pack("<IIQ", V.ARRAY, V.ARRAY, 1) + struct.pack("<IQ", V.ARRAY, 1) * \
            (depth - 1) + struct.pack("<IQB", V.UINT8, 1, 7)
        data = bytearray(dst.read_bytes())
        assert len(nested) == 4 + 8 + pad
        data[at:at + len(nested)] = nested
        dst.write_bytes(bytes(data))
    return corrupt


def _truncated_at(where: Callable[[Path], int]) -> Corruption:
    return lambda src, dst: truncate(src, dst, where(src))


_A = f"{ARCH}."
CORRUPTIONS: dict[str, Corruption] = {
    # header
    "bad-magic": lambda src, dst: patch(src, dst, 0, "4s", b"GGUX"),
    "version-1": lambda src, dst: patch(src, dst, 4, "I", 1),
    "architecture-unknown": _at_key("general.architecture", 12, "5s", b"gemma"),
    "n-tensors-zero": lambda src, dst: patch(src, dst, 8, "Q", 0),
    "n-tensors-2e40": lambda src, dst: patch(src, dst, 8, "Q", 2 ** 40),
    "n-kv-2e40": lambda src, dst: patch(src, dst, 16, "Q", 2 ** 40),
    "truncated-in-header": _truncated_at(lambda src: 30),
    "truncated-in-vocab": _truncated_at(lambda src: kv_value_offset(src, TOKENS_KEY) + 700),
    "truncated-in-tensor-table": _truncated_at(lambda src: tensor_info_offset(src, FIRST_WEIGHT)),
    "truncated-in-tensor-data": _truncated_at(lambda src: src.stat().st_size - 100),
    # KV section
    "vocab-count-2e40": _at_key(TOKENS_KEY, 8, "Q", 2 ** 40),
    "token-string-length-2e62": _at_key(TOKENS_KEY, 16, "Q", 2 ** 62),
    "merges-count-2e40": _at_key(MERGES_KEY, 8, "Q", 2 ** 40),
    "key-length-2e62": lambda src, dst: patch(src, dst, 24, "Q", 2 ** 62),
    "unknown-value-type": _at_key("general.name", 0, "I", 99),
    "unknown-array-type": _at_key(MERGES_KEY, 4, "I", 99),
    "nested-arrays-100k-deep": _nested_arrays(100_000),
    "alignment-0": _rewritten({"general.alignment": (0, V.UINT32)}),
    "alignment-3": _rewritten({"general.alignment": (3, V.UINT32)}),
    "alignment-negative": _rewritten({"general.alignment": (-32, V.INT32)}),
    "alignment-string": _rewritten({"general.alignment": ("32", V.STRING)}),
    # model metadata
    "head-count-0": _rewritten({_A + "attention.head_count": (0, V.UINT32)}),
    "head-count-kv-0": _rewritten({_A + "attention.head_count_kv": (0, V.UINT32)}),
    "head-count-kv-not-dividing": _rewritten({_A + "attention.head_count_kv": (3, V.UINT32)}),
    "embedding-length-string": _rewritten({_A + "embedding_length": ("64", V.STRING)}),
    "block-count-0": _rewritten({_A + "block_count": (0, V.UINT32)}),
    "block-count-2e31": _rewritten({_A + "block_count": (2 ** 31, V.UINT32)}),
    "block-count-negative": _rewritten({_A + "block_count": (-2, V.INT32)}),
    "rms-eps-nan": _rewritten({_A + "attention.layer_norm_rms_epsilon": (float("nan"),
                                                                         V.FLOAT32)}),
    "key-length-0": _rewritten({_A + "attention.key_length": (0, V.UINT32)}),
    "rope-dims-past-head": _rewritten({_A + "rope.dimension_count": (4096, V.UINT32)}),
    "context-length-0": _rewritten({_A + "context_length": (0, V.UINT32)}),
    "vocab-size-2e40": _rewritten({_A + "vocab_size": (2 ** 40, V.UINT64)}),
    # tokenizer metadata
    "merges-integers": _rewritten({MERGES_KEY: ([1, 2], V.ARRAY)}),
    "merges-without-space": _rewritten({MERGES_KEY: (["Ġt", "he"], V.ARRAY)}),
    "merges-of-unknown-tokens": _rewritten({MERGES_KEY: (["q z"], V.ARRAY)}),
    "tokens-not-strings": _rewritten({TOKENS_KEY: (list(range(259)), V.ARRAY)}),
    "tokens-a-string": _rewritten({TOKENS_KEY: ("abc", V.STRING)}),
    "token-types-strings": _rewritten({"tokenizer.ggml.token_type": (["1"] * 259, V.ARRAY)}),
    "eos-out-of-vocab": _rewritten({"tokenizer.ggml.eos_token_id": (10 ** 6, V.UINT32)}),
    "tokenizer-pre-unknown": _rewritten({"tokenizer.ggml.pre": ("klingon", V.STRING)}),
    "tokenizer-model-missing": _rewritten({"tokenizer.ggml.model": None}),
    "byte-token-misspelt": _rewritten({"tokenizer.ggml.token_type": ([6] + [1] * 257 + [3],
                                                                     V.ARRAY)}),
    "eos-negative": _rewritten({"tokenizer.ggml.eos_token_id": (-1, V.INT32)}),
    "bos-a-string": _rewritten({"tokenizer.ggml.bos_token_id": ("1", V.STRING)}),
    "chat-template-syntax-error": _rewritten({"tokenizer.chat_template": ("{% if %}", V.STRING)}),
    "chat-template-a-number": _rewritten({"tokenizer.chat_template": (7, V.UINT32)}),
    # tensor table
    "tensor-dim-zero": _at_tensor(FIRST_WEIGHT, 4, "Q", 0),
    "tensor-dim-2e62": _at_tensor(FIRST_WEIGHT, 4, "Q", 2 ** 62),
    "tensor-n-dims-2e31": _at_tensor(FIRST_WEIGHT, 0, "I", 2 ** 31),
    "tensor-type-unknown": _at_tensor(FIRST_WEIGHT, 4 + 16, "I", 99),
    "tensor-offset-misaligned": _offset_of(SECOND_WEIGHT, lambda old: old + 4),
    "tensor-past-end-of-file": _offset_of(SECOND_WEIGHT, lambda old: 2 ** 40),
    "tensors-overlap": _same_offset_as(SECOND_WEIGHT, FIRST_WEIGHT),
    "tensor-duplicated": _renamed(FIRST_WEIGHT, SECOND_WEIGHT),
    "tensor-missing": _rewritten(tensors={"blk.1.attn_norm.weight": None}),
    "token-embd-missing": _rewritten(tensors={"token_embd.weight": None}),
    "tensor-misshaped": _rewritten(tensors={"blk.0.attn_k.weight": np.zeros((32, 63),
                                                                          np.float32)}),
    "tensor-unexpected": _rewritten(tensors={"blk.0.bogus.weight": np.ones(64, np.float32)}),
}
