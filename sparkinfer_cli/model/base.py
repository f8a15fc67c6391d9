"""CausalLM: the shape every supported model shares, on the CPU.

    x = token_embd(ids)
    for each layer:  x = x + mixer(norm₁(x));  x = x + ffn(norm₂(x))
    logits = output(output_norm(x))

Which mixer (attention, gated attention or Gated DeltaNet) and which FFN (dense or MoE) each
layer has comes from its tensor records (tensors.py): one model class for every architecture.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.kernels.cpu.quant_packed import PackedWeight
from sparkinfer_cli.model.backend import ModelBackend
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.cache import ModelCache
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.gated_attention import GatedAttention
from sparkinfer_cli.model.gated_delta_net import GatedDeltaNet
from sparkinfer_cli.model.layers import Attention, Embedding, Forward, Linear, RMSNorm, SwiGLU
from sparkinfer_cli.model.moe import MoE
from sparkinfer_cli.model.tensors import (
    AttentionTensors,
    DeltaNetTensors,
    ModelTensors,
    MoETensors,
    SwiGLUTensors,
    resolve_tensors,
)

Mixer = Callable[[np.ndarray, Forward], np.ndarray]
FFN = Callable[[np.ndarray], np.ndarray]


@dataclass
class DecoderLayer:
    attn_norm: RMSNorm
    mixer: Mixer
    ffn_norm: RMSNorm
    ffn: FFN

    def __call__(self, x: np.ndarray, fwd: Forward) -> np.ndarray:
        x = x + self.mixer(self.attn_norm(x), fwd)
        return x + self.ffn(self.ffn_norm(x))


class CausalLM(ModelBackend[ModelCache]):
    """Every architecture on the CPU backend."""

    scores_drafts = True  # every token attends row by row (layers.Attention.attend)
    snapshots_draft_states = True  # GatedDeltaNet.run_sequence
    kv_dtype: type = np.float32  # of the KV cache: float16 with int8 decode

    def __init__(self, tensors: ModelTensors, config: ModelConfig):
        self.config = config
        self.token_embd = Embedding(tensors.token_embd)
        self.layers = [DecoderLayer(RMSNorm(t.attn_norm, config.rms_eps),
                                    _mixer(t.mixer, config, i),
                                    RMSNorm(t.ffn_norm, config.rms_eps), ffn_block(t.ffn, config))
                       for i, t in enumerate(tensors.layers)]
        self.output_norm = RMSNorm(tensors.output_norm, config.rms_eps)
        self.output = Linear(tensors.output)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, config: ModelConfig) -> CausalLM:
        return cls(resolve_tensors(gguf, config), config)

    def use_int8_decode(self, stored: Mapping[str, PackedWeight] | None = None
                        ) -> dict[str, PackedWeight]:
        """llama.cpp's numerics: every 2-D linear switched to int8-activation decode (see
        Linear.use_int8_decode), the decode calls of linears that share an input fused (q/k/v,
        gate/up), and caches created from now on keep K/V in float16 (llama.cpp's default
        cache type; the attention of a long context reads half the bytes). `stored`: records
        packed earlier, by weight name; returns every linear's, by name."""
        self.kv_dtype = np.float16
        stored = stored or {}
        packed = {}
        for linear in _find(self, Linear):
            linear.use_int8_decode(stored.get(linear.weight.name))
            if linear.packed is not None:
                packed[linear.weight.name] = linear.packed
        for block in _find(self, (Attention, SwiGLU)):
            block.fuse_int8_decode()
        return packed

    def packable_linears(self) -> list[Linear]:
        return [linear for linear in _find(self, Linear) if linear.is_packable]

    def create_cache(self, num_blocks: int, block_size: int, num_state_slots: int) -> ModelCache:
        return ModelCache(self.config, num_blocks, block_size, num_state_slots, self.kv_dtype)

    def forward(self, batch: SequenceBatch, cache: ModelCache) -> np.ndarray:
        """Logits (num_seqs, V) for each sequence's last new token, or (N, V) if all_logits."""
        return self.output(self.output_norm(self._trunk(batch, cache)[batch.logit_rows()]))

    def forward_hidden(self, batch: SequenceBatch,
                       cache: ModelCache) -> tuple[np.ndarray, np.ndarray]:
        hidden = self.output_norm(self._trunk(batch, cache))  # row by row: forward's rows too
        return self.output(hidden[batch.logit_rows()]), hidden

    def _trunk(self, batch: SequenceBatch, cache: ModelCache) -> np.ndarray:
        """(N, n_embd): every new token through every layer."""
        fwd = Forward(batch.positions(), batch.spans(), cache)
        x = self.token_embd(batch.token_ids)  # (N, n_embd)
        for layer in self.layers:
            x = layer(x, fwd)
        return x


def _mixer(t: AttentionTensors | DeltaNetTensors, cfg: ModelConfig, layer: int) -> Mixer:
    if isinstance(t, DeltaNetTensors):
        return GatedDeltaNet(t, cfg, layer)
    return GatedAttention(t, t.q_gate, cfg, layer) if t.q_gate is not None else \
        Attention(t, cfg, layer)


def ffn_block(t: SwiGLUTensors | MoETensors, cfg: ModelConfig) -> FFN:
    return MoE(t, cfg) if isinstance(t, MoETensors) else SwiGLU(t)


def _find(root: object, kind: type | tuple[type, ...]) -> list:
    """Every `kind` instance reachable from root through attributes and lists (each once)."""
    found, seen, stack = [], set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, kind):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (np.ndarray, type)):
            stack.extend(vars(obj).values())
    return found
