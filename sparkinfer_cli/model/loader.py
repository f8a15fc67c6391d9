"""load_model: GGUF file → the model on the chosen backend."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from sparkinfer_cli import env
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.model.backend import ModelBackend
from sparkinfer_cli.model.base import CausalLM
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.packed_cache import use_cached_int8_decode
from sparkinfer_cli.model.required_tensors import check_required_tensors
from sparkinfer_cli.model.tensors import MtpTensors, resolve_mtp_tensors

log = logging.getLogger(__name__)


def load_model(path: str | Path | GGUFFile, device: str = "cpu", *,
               int8_decode: bool = False, kv_int8: bool = False, with_mtp: bool = False,
               mtp_file: str | Path | None = None) -> ModelBackend:
    """int8_decode (CPU): llama.cpp's numerics, ~2x faster: activations quantized to int8, an
    F16 KV cache; off, every op is float32 (what the oracle tests check to 1e-3), the cache too.
    kv_int8 (CUDA): int8 KV cache with a scale per 32 values (SPARKINFER_KV_INT8), half of F16's
    memory. with_mtp: the MTP head too (model.mtp), the file's or mtp_file's (mtp_tensors;
    ValueError where there is none)."""
    gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    config = checked_config(gguf)
    head = mtp_tensors(gguf, config, mtp_file) if with_mtp else None
    if device == "cuda":
        from sparkinfer_cli.backend.cuda.model import (
            load_cuda_model,  # imports numba.cuda only here
        )
        cuda_model = load_cuda_model(gguf, config, kv_int8=kv_int8)
        if head is not None:
            from sparkinfer_cli.backend.cuda.mtp import CudaMtpHead
            cuda_model.mtp = CudaMtpHead(head, cuda_model)
        return cuda_model
    if device != "cpu":
        raise ValueError(f"device {device!r} is not available in this build (use 'cpu' or 'cuda')")
    model = CausalLM.from_gguf(gguf, config)
    if head is not None:
        from sparkinfer_cli.model.mtp import MtpHead
        model.mtp = MtpHead(head, model)
    if int8_decode:
        model.use_int8_decode()
    return model


def mtp_tensors(model_file: GGUFFile, config: ModelConfig,
                head_file: str | Path | None = None) -> MtpTensors:
    """The MTP head of model_file, or of head_file: a head-only GGUF for model_file's model
    (llama.cpp's convert_hf_to_gguf.py --mtp: the head's block after as many blocks as the
    model's trunk has). ValueError naming the file where there is none or it does not fit."""
    if head_file is None:
        tensors = resolve_mtp_tensors(model_file, config)
        if tensors is None:
            raise ValueError(f"{model_file.path.name} has no MTP head (nextn_predict_layers); "
                             "a head-only file goes in --model-draft")
        return tensors
    head = GGUFFile(head_file)
    arch = head.get("general.architecture")
    layers = head.typed(f"{arch}.nextn_predict_layers", int) or 0
    blocks = head.typed(f"{arch}.block_count", int) or 0
    tokens = head.get("tokenizer.ggml.tokens")
    if arch != config.arch or blocks - layers != config.n_layer or \
            head.typed(f"{arch}.embedding_length", int) != config.n_embd:
        raise ValueError(f"{head.path.name} is no MTP head of {model_file.path.name}: its "
                         "architecture, block count or width differ")
    if tokens is not None and tokens != model_file.get("tokenizer.ggml.tokens"):
        raise ValueError(f"{head.path.name}: its tokens differ from {model_file.path.name}'s")
    tensors = resolve_mtp_tensors(head, dataclasses.replace(config, mtp_layers=layers))
    if tensors is None:
        raise ValueError(f"{head.path.name} has no MTP head (nextn_predict_layers)")
    return tensors


def checked_config(gguf: GGUFFile) -> ModelConfig:
    """The config of a file whose metadata and tensor table pass every check that can be made
    before a weight is read (unsupported architectures, hostile values, missing tensors)."""
    config = ModelConfig.from_gguf(gguf)
    check_required_tensors(gguf, config)
    return config


def check_draft_model(draft: GGUFFile, target: GGUFFile) -> ModelConfig:
    """The config of a file that can draft for target's model (speculative decoding): attention
    layers only (a draft's recurrent state could not be rewound) and the same token list."""
    config = checked_config(draft)
    if config.is_hybrid:
        raise ValueError(f"{draft.path.name}: a draft model must have attention layers only "
                         "(Qwen3, Qwen2, Llama); this one keeps a recurrent state")
    if draft.get("tokenizer.ggml.tokens") != target.get("tokenizer.ggml.tokens"):
        raise ValueError(f"{draft.path.name}: a draft model needs the vocabulary of "
                         f"{target.path.name}, and its tokens differ")
    return config


def load_runtime_model(gguf: GGUFFile, device: str, environ: Mapping[str, str] | None = None,
                       report: Callable[[str], None] = lambda _: None, with_mtp: bool = False,
                       mtp_file: str | Path | None = None) -> ModelBackend:
    """The model as generate / serve / bench run it: int8 decode on the CPU over packed records
    kept in the user's cache between runs (packed_cache); on CUDA an int8 KV cache when
    SPARKINFER_KV_INT8 is set (the CPU cache stays F16, and a warning says so). `report`
    hears what takes time, as it starts."""
    kv_int8 = bool(env.SPARKINFER_KV_INT8.get(environ))
    if kv_int8 and device != "cuda":
        log.warning("SPARKINFER_KV_INT8 applies to the CUDA backend: the CPU KV cache stays F16")
    report(f"loading {gguf.path.name}")
    model = load_model(gguf, device, kv_int8=kv_int8 and device == "cuda", with_mtp=with_mtp,
                       mtp_file=mtp_file)
    if isinstance(model, CausalLM):  # the CPU model
        use_cached_int8_decode(model, gguf.path, report=report)
    return model


def load_draft_model(path: str | Path, target: GGUFFile, device: str,
                     environ: Mapping[str, str] | None = None,
                     report: Callable[[str], None] = lambda _: None) -> ModelBackend:
    """The draft model in path, checked against target's and loaded as load_runtime_model loads
    a model."""
    draft = GGUFFile(path)
    check_draft_model(draft, target)
    return load_runtime_model(draft, device, environ, report)
