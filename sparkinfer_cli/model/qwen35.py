"""qwen35 (Qwen3.5 / Qwen3.6 dense): the hybrid layout shared by qwen35moe and qwen3next.

Layer i is a Gated DeltaNet layer or a gated full-attention layer (config.recurrent_layers, from
attention.recurrent_layers or every full_attention_interval-th layer); each is followed by
post_attention_norm and the FFN, dense SwiGLU here. The converter reorders V heads to tiled order,
so v-head h reads q/k head h mod H_k (llama.cpp's conversion). IMROPE with text positions
(p,p,p,0) equals NEOX RoPE on the first n_rot dims.
"""

from __future__ import annotations

from sparkinfer_cli.model.base import FFN, CausalLM, DecoderLayer, Mixer
from sparkinfer_cli.model.gated_attention import GatedAttention
from sparkinfer_cli.model.gated_delta_net import GatedDeltaNet
from sparkinfer_cli.model.layers import SwiGLU
from sparkinfer_cli.model.weights import Weights


class Model(CausalLM):
    gdn_head_map = "mod"  # v-head h → q/k head h mod H_k

    def build_layer(self, w: Weights, layer: int) -> DecoderLayer:
        p = f"blk.{layer}."
        return DecoderLayer(
            attn_norm=self.norm(w, p + "attn_norm.weight"),
            mixer=self.build_mixer(w, layer),
            ffn_norm=self.norm(w, p + "post_attention_norm.weight"),
            ffn=self.build_ffn(w, layer),
        )

    def build_mixer(self, w: Weights, layer: int) -> Mixer:
        if self.config.is_recurrent(layer):
            return GatedDeltaNet(w, self.config, layer, self.gdn_head_map)
        return GatedAttention(w, self.config, layer)

    def build_ffn(self, w: Weights, layer: int) -> FFN:
        cfg = self.config
        return SwiGLU(w, f"blk.{layer}.ffn_", "", cfg.n_embd, cfg.n_ff)
