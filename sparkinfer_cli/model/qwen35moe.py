"""qwen35moe (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B): qwen35's hybrid layers with a routed MoE FFN and a
sigmoid-gated shared expert in every layer (llama.cpp's src/models/qwen35moe.cpp)."""

from __future__ import annotations

from sparkinfer_cli.model import qwen35
from sparkinfer_cli.model.base import FFN
from sparkinfer_cli.model.moe import MoE
from sparkinfer_cli.model.weights import Weights


class Model(qwen35.Model):
    def build_ffn(self, w: Weights, layer: int) -> FFN:
        return MoE(w, self.config, layer, shared_expert=True)
