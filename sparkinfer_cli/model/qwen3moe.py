"""qwen3moe (Qwen3-30B-A3B): qwen3's attention (per-head q/k RMSNorm, NEOX RoPE) with a routed MoE
FFN in every layer and no shared expert (llama.cpp's src/models/qwen3moe.cpp)."""

from __future__ import annotations

from sparkinfer_cli.model.base import CausalLM, DecoderLayer
from sparkinfer_cli.model.layers import Attention
from sparkinfer_cli.model.moe import MoE
from sparkinfer_cli.model.weights import Weights


class Model(CausalLM):
    def build_layer(self, w: Weights, layer: int) -> DecoderLayer:
        cfg, p = self.config, f"blk.{layer}."
        return DecoderLayer(
            attn_norm=self.norm(w, p + "attn_norm.weight"),
            mixer=Attention(w, cfg, layer, qkv_bias=False, qk_norm=True),
            ffn_norm=self.norm(w, p + "ffn_norm.weight"),
            ffn=MoE(w, cfg, layer, shared_expert=False),
        )
