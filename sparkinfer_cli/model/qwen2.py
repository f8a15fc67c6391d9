"""qwen2 (Qwen2 / Qwen2.5): llama with q/k/v biases and NEOX RoPE."""

from sparkinfer_cli.model.dense import DenseCausalLM


class Model(DenseCausalLM):
    qkv_bias = True
