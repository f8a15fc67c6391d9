"""The multi-token-prediction (NextN) head of Qwen3.5 / Qwen3.6 files, on the CPU (llama.cpp's
qwen35 MTP graph):

    x = eh_proj([enorm(embed(token at q)) | hnorm(h at q − 1)])   # h: the trunk's normed hidden
    x = decoder layer (gated full attention over the head's own KV, the trunk's kind of FFN)
    h' = shared_head_norm(x);  logits = output(h')                 # predicts the token at q + 1

so a pair (hidden state at p, token p + 1) sits at position p + 1 of the head's cache (the first
token pairs with zeros). Drafting continues from the head's own h' and its argmax token.
"""

from __future__ import annotations

import numpy as np

from sparkinfer_cli.model.backend import NextTokenHead
from sparkinfer_cli.model.base import CausalLM, DecoderLayer, ffn_block
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.cache import ModelCache
from sparkinfer_cli.model.gated_attention import GatedAttention
from sparkinfer_cli.model.layers import Forward, Linear, RMSNorm
from sparkinfer_cli.model.tensors import AttentionTensors, MtpTensors


class MtpHead(NextTokenHead[ModelCache]):
    def __init__(self, t: MtpTensors, trunk: CausalLM):
        # the head's cache holds one attention layer: index 0 of a one-layer config
        self.config = trunk.config.mtp_head_config()
        eps = self.config.rms_eps
        assert isinstance(t.layer.mixer, AttentionTensors) and t.layer.mixer.q_gate is not None
        self.layer = DecoderLayer(RMSNorm(t.layer.attn_norm, eps),
                                  GatedAttention(t.layer.mixer, t.layer.mixer.q_gate,
                                                 self.config, 0),
                                  RMSNorm(t.layer.ffn_norm, eps),
                                  ffn_block(t.layer.ffn, self.config))
        self.eh_proj = Linear(t.eh_proj)
        self.enorm, self.hnorm = RMSNorm(t.enorm, eps), RMSNorm(t.hnorm, eps)
        self.head_norm = RMSNorm(t.head_norm, eps)
        self.trunk = trunk  # its embedding, LM head and KV type

    def create_cache(self, num_blocks: int, block_size: int) -> ModelCache:
        return ModelCache(self.config, num_blocks, block_size, 0, self.trunk.kv_dtype)

    def forward(self, hidden: np.ndarray, batch: SequenceBatch,
                cache: ModelCache) -> tuple[np.ndarray, np.ndarray]:
        fwd = Forward(batch.positions(), batch.spans(), cache)
        x = np.concatenate([self.enorm(self.trunk.token_embd(batch.token_ids)),
                            self.hnorm(hidden)], axis=1)  # (N, 2E)
        x = self.layer(self.eh_proj(x), fwd)
        h = self.head_norm(x[batch.logit_rows()])
        return self.trunk.output(h), h
