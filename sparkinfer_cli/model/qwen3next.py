"""qwen3next (Qwen3-Next-80B-A3B, Qwen3-Coder-Next): qwen35moe's layers, but the GGUF keeps HF's
grouped V-head order, so v-head h reads q/k head h / (H_v/H_k) (llama.cpp's qwen3next.cpp). Its GDN
layers have a fused ssm_ba and, in older files, a fused ssm_in (split at load)."""

from __future__ import annotations

from sparkinfer_cli.model import qwen35moe


class Model(qwen35moe.Model):
    gdn_head_map = "div"  # v-head h → q/k head h // (H_v / H_k)
