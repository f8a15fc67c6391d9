"""How large a KV pool the server may allocate: what the chosen device's memory allows.

A GGUF's trained context can be far beyond any machine (a hostile 2^40, or a real 1M-token model
on a laptop). The pool is sized from the memory that exists before anything is allocated: a pool
the user asked for that does not fit is refused, the model's default is capped, and both say so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sparkinfer_cli import env
from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.units import format_bytes

# the KV pool's share of the memory left after the weights: the rest is for repacked weights,
# activations and the rest of the process
KV_MEMORY_SHARE = 0.5
MIN_POOL_TOKENS = 256  # below this a capped pool serves nothing useful: refuse instead
_CGROUP_LIMIT = Path("/sys/fs/cgroup/memory.max")


@dataclass(frozen=True)
class KVPool:
    ctx: int | None  # what to pass as the server's --ctx (None: as the user left it)
    note: str  # for the user when the pool was capped, else ""


def kv_cache_type(device: str, environ: Mapping[str, str] | None = None) -> str:
    """The cache the device really allocates: F16, or on CUDA int8 with a float32 scale per 32
    values under SPARKINFER_KV_INT8."""
    if device == "cuda" and env.SPARKINFER_KV_INT8.get(environ):
        return "int8"
    return "F16"


_BYTES_PER_VALUE = {"F16": 2.0, "int8": 1 + 4 / 32}


def kv_bytes_per_value(device: str, environ: Mapping[str, str] | None = None) -> float:
    """Bytes a cached K or V value takes in kv_cache_type's cache."""
    return _BYTES_PER_VALUE[kv_cache_type(device, environ)]


def available_memory_bytes(device: str) -> int | None:
    """Free memory of the device the KV cache lives on; None when it cannot be told."""
    if device == "cuda":
        try:
            from numba import cuda
            return int(cuda.current_context().get_memory_info()[0])
        except Exception:  # no driver or numba-cuda: leave the pool as asked
            return None
    return _host_available_bytes()


def _host_available_bytes() -> int | None:
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines()
                         if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    try:  # a container's own limit, when tighter than the host's free memory
        limit = _CGROUP_LIMIT.read_text().strip()
        return min(available, int(limit)) if limit.isdigit() else available
    except OSError:
        return available


def state_pool_bytes(config: ModelConfig, environ: Mapping[str, str] | None = None,
                     spec_tokens: int | None = None) -> int:
    """A hybrid model's recurrent-state slots as the server allocates them: one per sequence
    (and those a step's checks keep states in where drafts are checked: spec_tokens, default
    SPARKINFER_SPEC_TOKENS; EngineConfig.num_seq_slots), the prefix cache's snapshots and the
    configured prefix's (SPARKINFER_PREFIX_CACHE*)."""
    if not config.is_hybrid:
        return 0
    has_prefix = bool(env.SPARKINFER_SERVER_PREFIX_TOKEN_FILE.get(environ) or
                      env.SPARKINFER_SERVER_PREFIX_TOKEN_IDS.get(environ))
    spec = env.SPARKINFER_SPEC_TOKENS.get(environ) if spec_tokens is None else spec_tokens
    engine = EngineConfig(prefix_cache=env.SPARKINFER_PREFIX_CACHE.get(environ),
                          prefix_snapshots=env.SPARKINFER_PREFIX_CACHE_SNAPSHOTS.get(environ),
                          prefix_token_ids=(0,) if has_prefix else (),  # NOTE: its length is moot
                          spec_tokens=spec)
    return engine.num_state_slots(True) * config.recurrent_state_bytes()


@dataclass(frozen=True)
class DraftFit:
    """What a drafter adds to the memory a server needs: a draft model's config and weights, or
    an MTP head's layer (ModelConfig.mtp_head_config) and a head-only file's weights."""
    config: ModelConfig
    weights_bytes: int


def fit_kv_pool(config: ModelConfig, ctx: int | None, device: str, weights_bytes: int,
                environ: Mapping[str, str] | None = None,
                spec_tokens: int | None = None, draft: DraftFit | None = None) -> KVPool:
    """The server's KV pool for --ctx `ctx` (None: $CTX; unset or 0: the trained context), beside
    the weights and the recurrent-state slots (hybrid models; spec_tokens: state_pool_bytes),
    which are allocated whatever the pool; a drafter's weights and KV (as many tokens as the
    pool) count too."""
    asked = env.CTX.get(environ) if ctx is None else ctx
    tokens = asked or config.context_length
    kv_values = config.kv_bytes_per_token(1) + (draft.config.kv_bytes_per_token(1) if draft else 0)
    per_token = kv_values * kv_bytes_per_value(device, environ)
    fixed = weights_bytes + state_pool_bytes(config, environ, spec_tokens) + \
        (draft.weights_bytes if draft else 0)
    memory = available_memory_bytes(device)
    if memory is None or tokens * per_token <= (budget := _kv_budget(memory, fixed)):
        return KVPool(ctx, "")
    need = f"a KV pool of {tokens:,} tokens needs {format_bytes(tokens * per_token)}"
    room = (f"this {device} can spare {format_bytes(budget)} for it ({KV_MEMORY_SHARE:.0%} of "
            f"{format_bytes(memory)} of free memory less {format_bytes(fixed)} of weights and "
            f"recurrent state)")
    block = EngineConfig.block_size
    capped = int(budget // per_token) // block * block
    if asked:
        raise ValueError(f"--ctx / CTX: {need}, but {room}: ask for fewer tokens")
    if capped < MIN_POOL_TOKENS:
        raise ValueError(f"the model's trained context: {need}, but {room}: fewer than "
                         f"{MIN_POOL_TOKENS} tokens fit")
    return KVPool(capped, f"the model's trained context: {need}, but {room}: the pool holds "
                          f"{capped:,} tokens (--ctx sets it)")


def _kv_budget(memory: int, weights_bytes: int) -> float:
    return max(0, memory - weights_bytes) * KV_MEMORY_SHARE
