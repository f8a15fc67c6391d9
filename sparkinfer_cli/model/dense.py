"""The dense decoder layer shared by llama, qwen2 and qwen3: GQA attention + SwiGLU FFN."""

from __future__ import annotations

from sparkinfer_cli.model.base import CausalLM, DecoderLayer
from sparkinfer_cli.model.layers import Attention, SwiGLU
from sparkinfer_cli.model.weights import Weights


class DenseCausalLM(CausalLM):
    qkv_bias = False
    qk_norm = False

    def build_layer(self, w: Weights, layer: int) -> DecoderLayer:
        cfg, p = self.config, f"blk.{layer}."
        return DecoderLayer(
            attn_norm=self.norm(w, p + "attn_norm.weight"),
            mixer=Attention(w, cfg, layer, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm),
            ffn_norm=self.norm(w, p + "ffn_norm.weight"),
            ffn=SwiGLU(w, p + "ffn_", "", cfg.n_embd, cfg.n_ff),
        )
