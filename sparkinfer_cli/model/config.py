"""ModelConfig: the hyperparameters of a GGUF model, read once from metadata."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from sparkinfer_cli.gguf.reader import GGUFError, UnusableModelError

if TYPE_CHECKING:
    from sparkinfer_cli.gguf.reader import GGUFFile

SUPPORTED_ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe")
HYBRID_ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe")
ROPE_NORMAL, ROPE_NEOX = "normal", "neox"  # normal: adjacent pairs (llama); neox: halves
_T = TypeVar("_T", int, float)


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
    mtp_layers: int = 0  # NextN / MTP blocks after the trunk (nextn_predict_layers)

    def __post_init__(self) -> None:
        # NOTE: messages name the metadata keys, since from_gguf's caller sees them as file errors
        checks = [
            (self.n_layer >= 1, "block_count leaves no layer to run"),
            (self.n_head % self.n_head_kv == 0,
             f"attention.head_count_kv ({self.n_head_kv}) must divide attention.head_count "
             f"({self.n_head})"),
            (self.n_rot <= self.head_dim and self.n_rot % 2 == 0,
             f"rope.dimension_count ({self.n_rot}) must be even and at most the head size "
             f"({self.head_dim})"),
            (not self.n_expert or 1 <= self.n_expert_used <= self.n_expert,
             f"expert_used_count ({self.n_expert_used}) must be in 1..expert_count "
             f"({self.n_expert})"),
            (len(self.recurrent_layers) in (0, self.n_layer),
             "attention.recurrent_layers must give every layer"),
            (not self.is_hybrid or min(self.ssm_conv_kernel, self.ssm_d_state, self.ssm_n_group,
                                       self.ssm_n_v_heads, self.ssm_inner_size) >= 1,
             "a hybrid model needs ssm.conv_kernel, state_size, group_count, time_step_rank "
             "and inner_size of at least 1"),
            (not self.is_hybrid or self.ssm_inner_size % self.ssm_n_v_heads == 0,
             "ssm.time_step_rank must divide ssm.inner_size"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelConfig:
        """The file's config, every value type- and range-checked before anything is sized from
        it (loader.checked_config also checks the tensor table against it)."""
        arch = gguf.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnusableModelError(f"{gguf.path}: unsupported architecture {arch!r} "
                                     f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        k = _ArchKeys(gguf, arch)
        n_embd, n_head = k.integer("embedding_length"), k.integer("attention.head_count")
        mtp_layers = k.integer("nextn_predict_layers", 0, minimum=0)
        n_layer = k.integer("block_count") - mtp_layers
        _check_blocks_exist(gguf, n_layer)
        head_dim = k.integer("attention.key_length", max(n_embd // n_head, 1))
        tokens = gguf.typed_list("tokenizer.ggml.tokens", str)
        try:
            config = cls(
                arch=arch, n_vocab=k.integer("vocab_size", len(tokens or ())) or
                gguf.tensor("token_embd.weight").shape[-1],
                n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                n_head_kv=k.integer("attention.head_count_kv", n_head), head_dim=head_dim,
                n_ff=k.integer("feed_forward_length", 0, minimum=0),
                context_length=k.integer("context_length", 4096),
                rms_eps=k.number("attention.layer_norm_rms_epsilon"),
                rope_base=k.number("rope.freq_base", 10000.0),
                n_rot=k.integer("rope.dimension_count", head_dim),
                rope_style=ROPE_NORMAL if arch == "llama" else ROPE_NEOX,
                tied_embeddings="output.weight" not in gguf.tensors,
                n_expert=k.integer("expert_count", 0, minimum=0),
                n_expert_used=k.integer("expert_used_count", 0, minimum=0),
                n_ff_exp=k.integer("expert_feed_forward_length", 0, minimum=0),
                n_ff_shexp=k.integer("expert_shared_feed_forward_length", 0, minimum=0),
                recurrent_layers=_recurrent_layers(k, arch, n_layer), mtp_layers=mtp_layers,
                **{field: k.integer(key, 0, minimum=0) for field, key in _SSM_KEYS.items()})
        except ValueError as exc:  # __post_init__'s checks; GGUFError passes through with its path
            raise exc if isinstance(exc, GGUFError) else GGUFError(f"{gguf.path}: {exc}") from None
        return config

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

    def mtp_head_config(self) -> ModelConfig:
        """The config an MTP head's own layer runs under: one full-attention layer (index 0 of
        its cache) with this model's widths."""
        return dataclasses.replace(self, n_layer=1, recurrent_layers=(), mtp_layers=0)

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """K and V of one token over all attention layers."""
        return 2 * len(self.attention_layers) * self.n_head_kv * self.head_dim * bytes_per_value

    def recurrent_state_bytes(self) -> int:
        """F32 conv + delta-rule state of one sequence over all Gated-DeltaNet layers."""
        conv = (self.ssm_conv_kernel - 1) * self.ssm_conv_dim
        delta = self.ssm_d_state * self.ssm_inner_size
        return 4 * (conv + delta) * len(self.recurrent_layer_ids)


_SSM_KEYS = {"ssm_conv_kernel": "ssm.conv_kernel", "ssm_d_state": "ssm.state_size",
             "ssm_n_group": "ssm.group_count", "ssm_n_v_heads": "ssm.time_step_rank",
             "ssm_inner_size": "ssm.inner_size"}


class _ArchKeys:
    """`{arch}.{suffix}` metadata values, type- and range-checked: a hostile value is a GGUFError
    here, never a ZeroDivisionError or a huge allocation later."""

    def __init__(self, gguf: GGUFFile, arch: str):
        self.gguf, self.arch = gguf, arch

    def _default(self, suffix: str, default: _T | None) -> _T:
        """The value of an absent key: its default; None: the key is required."""
        if default is None:
            raise UnusableModelError(
                f"{self.gguf.path}: metadata key {self.arch}.{suffix} is missing")
        return default

    def integer(self, suffix: str, default: int | None = None, minimum: int = 1) -> int:
        """The key's integer, at least minimum; its default when absent (None: required)."""
        value = self.gguf.typed(f"{self.arch}.{suffix}", int)
        if value is None:
            return self._default(suffix, default)
        if value < minimum:
            raise GGUFError(f"{self.gguf.path}: metadata key {self.arch}.{suffix} is {value}; "
                            f"it must be at least {minimum}")
        return int(value)

    def number(self, suffix: str, default: float | None = None) -> float:
        """A finite number > 0 (epsilons, frequency bases); default as integer's."""
        found = self.gguf.typed(f"{self.arch}.{suffix}", float)
        value = float(self._default(suffix, default) if found is None else found)
        if not (math.isfinite(value) and value > 0):
            raise GGUFError(f"{self.gguf.path}: metadata key {self.arch}.{suffix} is {value}; "
                            "it must be a finite number above 0")
        return value

    def flags(self, suffix: str) -> list[bool] | None:
        return self.gguf.typed_list(f"{self.arch}.{suffix}", bool)


def _check_blocks_exist(gguf: GGUFFile, n_layer: int) -> None:
    """block_count must not exceed the blocks the tensor table holds: per-layer tables are sized
    from it (a hostile 2^31 would be a MemoryError)."""
    last = f"blk.{n_layer - 1}."
    if n_layer > 0 and not any(name.startswith(last) for name in gguf.tensors):
        if f"blk.{n_layer}.nextn.eh_proj.weight" in gguf.tensors:
            raise UnusableModelError(f"{gguf.path}: an MTP head without its model (llama.cpp's "
                                     "--mtp file): give it as --model-draft with --spec-type "
                                     "mtp beside the model")
        raise GGUFError(f"{gguf.path}: the metadata gives {n_layer} layers, but the file has no "
                        f"tensors for layer {n_layer - 1}")


def _recurrent_layers(k: _ArchKeys, arch: str, n_layer: int) -> tuple[bool, ...]:
    if arch not in HYBRID_ARCHITECTURES:
        return ()
    explicit = k.flags("attention.recurrent_layers")
    if explicit is not None:
        return tuple(bool(v) for v in explicit[:n_layer])
    interval = k.integer("full_attention_interval", 4)
    return tuple((i + 1) % interval != 0 for i in range(n_layer))
