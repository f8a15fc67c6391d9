"""ModelConfig: the hyperparameters of a GGUF model, read once from metadata (ARCHITECTURES.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkinfer_cli.gguf_file import GGUFError

if TYPE_CHECKING:
    from sparkinfer_cli.gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe")
HYBRID_ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe")
ROPE_NORMAL, ROPE_NEOX = "normal", "neox"  # normal: adjacent pairs (llama); neox: halves


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int  # trunk layers (block_count − nextn_predict_layers)
    n_head: int
    n_head_kv: int
    head_dim: int  # key_length (= value_length for every supported arch)
    n_ff: int
    context_length: int
    rms_eps: float
    rope_base: float
    n_rot: int
    rope_style: str
    tied_embeddings: bool
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    recurrent_layers: tuple[bool, ...] = ()  # per layer: Gated-DeltaNet (True) or attention
    ssm_conv_kernel: int = 0
    ssm_d_state: int = 0  # head_k_dim = head_v_dim
    ssm_n_group: int = 0  # H_k
    ssm_n_v_heads: int = 0  # H_v
    ssm_inner_size: int = 0  # H_v · head_v_dim

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelConfig:
        arch = gguf.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"{gguf.path}: unsupported architecture {arch!r} "
                            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        key = gguf.arch_key

        def required(suffix: str):
            value = key(suffix)
            if value is None:
                raise GGUFError(f"{gguf.path}: metadata key {arch}.{suffix} is missing")
            return value

        n_embd, n_head = int(required("embedding_length")), int(required("attention.head_count"))
        n_layer = int(required("block_count")) - int(key("nextn_predict_layers", 0))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        tokens = gguf.get("tokenizer.ggml.tokens")
        n_vocab = int(key("vocab_size", 0)) or (len(tokens) if tokens else 0) or \
            gguf.tensor("token_embd.weight").shape[1]
        return cls(
            arch=arch, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
            n_head_kv=int(key("attention.head_count_kv", n_head)), head_dim=head_dim,
            n_ff=int(key("feed_forward_length", 0)),
            context_length=int(key("context_length", 4096)),
            rms_eps=float(required("attention.layer_norm_rms_epsilon")),
            rope_base=float(key("rope.freq_base", 10000.0)),
            n_rot=int(key("rope.dimension_count", head_dim)),
            rope_style=ROPE_NORMAL if arch == "llama" else ROPE_NEOX,
            tied_embeddings="output.weight" not in gguf.tensors,
            n_expert=int(key("expert_count", 0)), n_expert_used=int(key("expert_used_count", 0)),
            n_ff_exp=int(key("expert_feed_forward_length", 0)),
            n_ff_shexp=int(key("expert_shared_feed_forward_length", 0)),
            recurrent_layers=_recurrent_layers(gguf, arch, n_layer),
            ssm_conv_kernel=int(key("ssm.conv_kernel", 0)),
            ssm_d_state=int(key("ssm.state_size", 0)),
            ssm_n_group=int(key("ssm.group_count", 0)),
            ssm_n_v_heads=int(key("ssm.time_step_rank", 0)),
            ssm_inner_size=int(key("ssm.inner_size", 0)),
        )

    # ---- derived ------------------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        return any(self.recurrent_layers)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layer) if not self.is_recurrent(i))

    @property
    def recurrent_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layer) if self.is_recurrent(i))

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    @property
    def ssm_conv_dim(self) -> int:
        return 2 * self.ssm_n_group * self.ssm_d_state + self.ssm_inner_size

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """K and V of one token over all attention layers."""
        return 2 * len(self.attention_layers) * self.n_head_kv * self.head_dim * bytes_per_value

    def recurrent_state_bytes(self) -> int:
        """F32 conv + delta-rule state of one sequence over all Gated-DeltaNet layers."""
        conv = (self.ssm_conv_kernel - 1) * self.ssm_conv_dim
        delta = self.ssm_d_state * self.ssm_inner_size
        return 4 * (conv + delta) * len(self.recurrent_layer_ids)


def _recurrent_layers(gguf: GGUFFile, arch: str, n_layer: int) -> tuple[bool, ...]:
    if arch not in HYBRID_ARCHITECTURES:
        return ()
    explicit = gguf.arch_key("attention.recurrent_layers")
    if explicit is not None:
        return tuple(bool(v) for v in explicit[:n_layer])
    interval = int(gguf.arch_key("full_attention_interval", 4))
    return tuple((i + 1) % interval != 0 for i in range(n_layer))
