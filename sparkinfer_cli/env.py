"""Every environment variable sparkinfer reads, typed, in one place (seed README, "Env").

Each variable is an `EnvVar` whose `.get()` parses the current value (or returns the default when it
is unset or empty) and raises `EnvError` naming the variable when the value does not parse.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from sparkinfer_cli.engine.config import MAX_SPEC_TOKENS, SCHED_POLICIES

T = TypeVar("T")
# scheme://host[:port], as a browser's Origin header carries it: no path, not even a trailing /
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")


class EnvError(ValueError):
    """An environment variable whose value cannot be used; the message names it."""


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0/true/false/yes/no/on/off")


def parse_non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def parse_spec_tokens(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_SPEC_TOKENS:
        raise ValueError(f"must be 0 (off) to {MAX_SPEC_TOKENS}")
    return value


def parse_positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def parse_non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError("must be a finite number >= 0")
    return value


def parse_port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port in [0, 65535]")
    return value


def parse_new_file_path(text: str) -> str:
    """A file path whose directory exists and may be written (the file is made on first use)."""
    folder = Path(text).expanduser().parent
    if not folder.is_dir():
        raise ValueError(f"no directory {str(folder)!r} to write it in")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"directory {str(folder)!r} is not writable")
    return str(Path(text).expanduser())


def parse_sched_policy(text: str) -> str:
    value = text.strip().lower()
    if value not in SCHED_POLICIES:
        raise ValueError(f"must be one of {', '.join(SCHED_POLICIES)}")
    return value


def parse_token_ids(text: str) -> tuple[int, ...]:
    """'1,2, 3' → (1, 2, 3); token ids are non-negative."""
    ids = tuple(int(part) for part in text.split(",") if part.strip())
    if any(token_id < 0 for token_id in ids):
        raise ValueError("token ids must be >= 0")
    return ids


def parse_origins(text: str) -> tuple[str, ...]:
    """'http://a.example, https://b.example:8443' → the origins, lowercased as browsers send
    them; '*' = any origin; '' = none."""
    origins = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            # such an entry would never equal an Origin header: refused rather than ignored
            raise ValueError(f"{origin!r} is not an origin: expected scheme://host[:port] or *")
    return origins


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    help: str

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or not raw.strip():
            return self.default
        try:
            return self.parse(raw.strip())
        except ValueError as exc:
            raise EnvError(f"{self.name}={raw!r}: {exc}") from None


CTX: EnvVar[int | None] = EnvVar(
    "CTX", parse_non_negative_int, None,
    "KV pool size in tokens, same as --ctx; 0 = the model's trained context length")
HOST: EnvVar[str] = EnvVar("HOST", str, "127.0.0.1", "address the server binds")
PORT: EnvVar[int] = EnvVar("PORT", parse_port, 8080, "TCP port the server listens on")
SPARKINFER_ROOT: EnvVar[str] = EnvVar(
    "SPARKINFER_ROOT", str, ".", "base of relative paths in SPARKINFER_TOKENIZER_URL and "
    "SPARKINFER_SERVER_PREFIX_TOKEN_FILE")
SPARKINFER_API_KEY: EnvVar[str | None] = EnvVar(
    "SPARKINFER_API_KEY", str, None, "Bearer key required on every /v1/* route (same as --api-key)")
SPARKINFER_SERVED_MODEL_NAME: EnvVar[str | None] = EnvVar(
    "SPARKINFER_SERVED_MODEL_NAME", str, None,
    "model id /v1/models reports and responses carry (same as --alias); unset: general.name")
SPARKINFER_CORS_ORIGINS: EnvVar[tuple[str, ...]] = EnvVar(
    "SPARKINFER_CORS_ORIGINS", parse_origins, (),
    "comma-separated browser origins allowed by CORS, or * (same as --cors-origins); unset: off")
SPARKINFER_BATCH_TOKENS: EnvVar[int] = EnvVar(
    "SPARKINFER_BATCH_TOKENS", parse_positive_int, 64,
    "decode tokens packed per step before prompts may join")
SPARKINFER_STEP_TOKENS: EnvVar[int | None] = EnvVar(
    "SPARKINFER_STEP_TOKENS", parse_positive_int, None,
    "batched policy: tokens one step carries at most, decodes and prompt pieces together "
    "(unset: 2048 on a GPU, 256 on the CPU)")
SPARKINFER_SCHED_POLICY: EnvVar[str] = EnvVar(
    "SPARKINFER_SCHED_POLICY", parse_sched_policy, "batched",
    "batched | continuous (the seed's: one prefill a step) | chunked | priority")
SPARKINFER_PREFILL_CHUNK_TOKENS: EnvVar[int] = EnvVar(
    "SPARKINFER_PREFILL_CHUNK_TOKENS", parse_non_negative_int, 512,
    "prefill chunk size when batched prefill is unavailable (0 = unlimited)")
SPARKINFER_PREFILL_MIX_MAX: EnvVar[int] = EnvVar(
    "SPARKINFER_PREFILL_MIX_MAX", parse_non_negative_int, 2048,
    "largest prompt that may mix with decode in one step (0 = always mix)")
SPARKINFER_PREFILL_BATCHED: EnvVar[bool] = EnvVar(
    "SPARKINFER_PREFILL_BATCHED", parse_bool, True, "batched prefill for prefixes and cold prompts")
SPARKINFER_MAX_OUTPUT_TOKENS: EnvVar[int] = EnvVar(
    "SPARKINFER_MAX_OUTPUT_TOKENS", parse_positive_int, 4096, "per-request generation cap")
SPARKINFER_DECODE_STEPS: EnvVar[int] = EnvVar(
    "SPARKINFER_DECODE_STEPS", parse_positive_int, 8,
    "decode passes queued at once while every running request decodes greedily and none waits "
    "(GPU; 1 = one pass a step)")
SPARKINFER_MAX_QUEUE_DEPTH: EnvVar[int] = EnvVar(
    "SPARKINFER_MAX_QUEUE_DEPTH", parse_non_negative_int, 0,
    "cap on in-flight + queued requests; beyond it 429 (0 = unlimited)")
SPARKINFER_REQUEST_TIMEOUT_S: EnvVar[float] = EnvVar(
    "SPARKINFER_REQUEST_TIMEOUT_S", parse_non_negative_float, 0.0,
    "deadline from submission to finish; beyond it 504 (0 = disabled)")
SPARKINFER_SHUTDOWN_GRACE_S: EnvVar[float] = EnvVar(
    "SPARKINFER_SHUTDOWN_GRACE_S", parse_non_negative_float, 30.0,
    "after SIGTERM/SIGINT, how long in-flight requests may run before the process force-exits")
SPARKINFER_READ_TIMEOUT_S: EnvVar[float] = EnvVar(
    "SPARKINFER_READ_TIMEOUT_S", parse_non_negative_float, 300.0,
    "socket read timeout, reset on every byte received")
SPARKINFER_WRITE_TIMEOUT_S: EnvVar[float] = EnvVar(
    "SPARKINFER_WRITE_TIMEOUT_S", parse_non_negative_float, 300.0,
    "socket write timeout, reset on every byte sent")
SPARKINFER_SERVER_PREFIX_TOKEN_FILE: EnvVar[str | None] = EnvVar(
    "SPARKINFER_SERVER_PREFIX_TOKEN_FILE", str, None,
    "JSON file [id, ...] of a shared prompt prefix")
SPARKINFER_SERVER_PREFIX_TOKEN_IDS: EnvVar[tuple[int, ...]] = EnvVar(
    "SPARKINFER_SERVER_PREFIX_TOKEN_IDS", parse_token_ids, (),
    "comma-separated token ids of a shared prompt prefix")
SPARKINFER_PREFIX_CACHE: EnvVar[bool] = EnvVar(
    "SPARKINFER_PREFIX_CACHE", parse_bool, True,
    "reuse the KV (and hybrid models' state) of earlier requests' prompt prefixes; 0 = only the "
    "configured shared prefix")
SPARKINFER_PREFIX_CACHE_SNAPSHOTS: EnvVar[int] = EnvVar(
    "SPARKINFER_PREFIX_CACHE_SNAPSHOTS", parse_non_negative_int, 0,
    "hybrid models: recurrent-state snapshots the prefix cache keeps (0 = one per sequence slot)")
SPARKINFER_SPEC_TOKENS: EnvVar[int] = EnvVar(
    "SPARKINFER_SPEC_TOKENS", parse_spec_tokens, 0,
    "n-gram speculative decoding: drafted tokens a decode step checks at once (0 = off, at "
    "most 7)")
SPARKINFER_KV_INT8: EnvVar[bool | None] = EnvVar(
    "SPARKINFER_KV_INT8", parse_bool, None, "int8 KV cache (unset = the model's default)")
SPARKINFER_CUDA_PDL: EnvVar[bool] = EnvVar(
    "SPARKINFER_CUDA_PDL", parse_bool, True,
    "launch each CUDA kernel while the one before it runs (programmatic dependent launch, sm_90+)")
SPARKINFER_INT8_EXPERTS: EnvVar[bool] = EnvVar(
    "SPARKINFER_INT8_EXPERTS", parse_bool, False,
    "CUDA prefill: MoE experts of Q4_K / Q5_K on the int8 grouped GEMM over q8 activations "
    "(mmq_k) instead of the f16 tensor-core GEMMs (off: slower than them so far)")
SPARKINFER_F16_PREFILL: EnvVar[bool] = EnvVar(
    "SPARKINFER_F16_PREFILL", parse_bool, True,
    "CUDA prefill: keep f16 copies of the dense projections (2 bytes a weight) for the f16 "
    "tensor-core GEMM of long passes (gemm_f16); off: the quantized GEMMs, no extra memory")
SPARKINFER_GDN_CHUNKED: EnvVar[bool] = EnvVar(
    "SPARKINFER_GDN_CHUNKED", parse_bool, False,
    "CUDA prefill: the Gated DeltaNet delta rule a chunk of tokens at a time on tensor cores "
    "(gated_delta_chunked); off: token by token (delta_seq), measured faster so far")
SPARKINFER_BATCH_INVARIANT: EnvVar[bool] = EnvVar(
    "SPARKINFER_BATCH_INVARIANT", parse_bool, False,
    "CUDA: a request's numbers never depend on what shares its passes (greedy answers equal "
    "alone and under load), by keeping every pass within the tokens whose rows are computed as "
    "decodes alone (16): fewer tokens a step, slower under load")
SPARKINFER_STEP_TRACE: EnvVar[str] = EnvVar(
    "SPARKINFER_STEP_TRACE", parse_new_file_path, "",
    "file the engine appends one JSON line per step to: what it carried and what it cost")
SPARKINFER_TOKENIZER_URL: EnvVar[str | None] = EnvVar(
    "SPARKINFER_TOKENIZER_URL", str, None, "override where the tokenizer is downloaded from")

ALL_VARS: tuple[EnvVar, ...] = (
    CTX, HOST, PORT, SPARKINFER_ROOT, SPARKINFER_API_KEY, SPARKINFER_SERVED_MODEL_NAME,
    SPARKINFER_CORS_ORIGINS, SPARKINFER_BATCH_TOKENS, SPARKINFER_STEP_TOKENS,
    SPARKINFER_SCHED_POLICY, SPARKINFER_PREFILL_CHUNK_TOKENS, SPARKINFER_PREFILL_MIX_MAX,
    SPARKINFER_PREFILL_BATCHED, SPARKINFER_MAX_OUTPUT_TOKENS, SPARKINFER_DECODE_STEPS,
    SPARKINFER_MAX_QUEUE_DEPTH, SPARKINFER_REQUEST_TIMEOUT_S, SPARKINFER_SHUTDOWN_GRACE_S,
    SPARKINFER_READ_TIMEOUT_S, SPARKINFER_WRITE_TIMEOUT_S, SPARKINFER_SERVER_PREFIX_TOKEN_FILE,
    SPARKINFER_SERVER_PREFIX_TOKEN_IDS, SPARKINFER_PREFIX_CACHE, SPARKINFER_PREFIX_CACHE_SNAPSHOTS,
    SPARKINFER_SPEC_TOKENS, SPARKINFER_KV_INT8, SPARKINFER_CUDA_PDL, SPARKINFER_INT8_EXPERTS,
    SPARKINFER_F16_PREFILL, SPARKINFER_GDN_CHUNKED, SPARKINFER_BATCH_INVARIANT,
    SPARKINFER_STEP_TRACE, SPARKINFER_TOKENIZER_URL,
)


def prefix_token_ids(environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """The shared prefix from SPARKINFER_SERVER_PREFIX_TOKEN_FILE or _IDS (not both)."""
    path = SPARKINFER_SERVER_PREFIX_TOKEN_FILE.get(environ)
    ids = SPARKINFER_SERVER_PREFIX_TOKEN_IDS.get(environ)
    if path is None:
        return ids
    if ids:
        raise EnvError("set SPARKINFER_SERVER_PREFIX_TOKEN_FILE or "
                       "SPARKINFER_SERVER_PREFIX_TOKEN_IDS, not both")
    return _read_token_file(Path(SPARKINFER_ROOT.get(environ)) / path)  # relative: to the root


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_token_file(path: Path) -> tuple[int, ...]:
    name = SPARKINFER_SERVER_PREFIX_TOKEN_FILE.name
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EnvError(f"{name}={str(path)!r}: cannot read a JSON list of token ids "
                       f"({exc})") from None
    if not isinstance(data, list) or not all(_is_token_id(x) for x in data):
        raise EnvError(f"{name}={str(path)!r}: expected a JSON list of non-negative integers")
    return tuple(data)
