"""qwen3: attention with per-head q/k RMSNorm before NEOX RoPE, head_dim from key_length; SwiGLU."""

from sparkinfer_cli.model.dense import DenseCausalLM


class Model(DenseCausalLM):
    qk_norm = True
