"""llama: RMSNorm → attention (RoPE on adjacent pairs; the converter permuted q/k) → SwiGLU."""

from sparkinfer_cli.model.dense import DenseCausalLM


class Model(DenseCausalLM):
    pass
