"""ServerConfig: how the HTTP layer behaves (address, auth, limits, timeouts, shutdown)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from sparkinfer_cli import env
from sparkinfer_cli.engine.config import DEFAULT_STEP_TOKENS, MAX_SPEC_TOKENS, EngineConfig

DEFAULT_MODEL_NAME = "sparkinfer"  # when neither --alias, the environment nor a file names one


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None  # None = no auth
    model_name: str = DEFAULT_MODEL_NAME  # the id /v1/models reports and responses echo
    cors_origins: tuple[str, ...] = ()  # browser origins CORS allows; () = off, ("*",) = any
    max_output_tokens: int = 4096  # SPARKINFER_MAX_OUTPUT_TOKENS: caps max_tokens
    max_request_bytes: int = 16 * 1024 * 1024  # larger bodies get 413
    read_timeout_s: float = 300.0  # reset on every byte received
    write_timeout_s: float = 300.0  # reset on every byte sent
    request_timeout_s: float = 0.0  # submission → finish deadline (504); 0 = off
    shutdown_grace_s: float = 30.0  # after SIGTERM/SIGINT, then force exit
    retry_after_s: int = 1  # Retry-After on 429 / 503
    default_temperature: float = 1.0  # OpenAI's default when a request omits temperature
    max_n: int = 16  # choices per request
    parse_reasoning: bool = True  # split <think> into reasoning_content (when the vocab has it)

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port <= 65535, "port must be in [0, 65535]"),
            (self.api_key is None or bool(self.api_key), "api_key must not be empty"),
            (bool(self.model_name), "model_name must not be empty"),
            (self.max_output_tokens >= 1, "max_output_tokens must be >= 1"),
            (self.max_request_bytes >= 1024, "max_request_bytes must be >= 1024"),
            (self.read_timeout_s > 0 and self.write_timeout_s > 0, "timeouts must be > 0"),
            (self.request_timeout_s >= 0, "request_timeout_s must be >= 0"),
            (self.shutdown_grace_s >= 0, "shutdown_grace_s must be >= 0"),
            (self.retry_after_s >= 0, "retry_after_s must be >= 0"),
            (self.default_temperature >= 0, "default_temperature must be >= 0"),
            (self.max_n >= 1, "max_n must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 fallback_model_name: str = DEFAULT_MODEL_NAME, **overrides: Any) -> ServerConfig:
        """Defaults ← environment (HOST, PORT, SPARKINFER_*) ← explicit overrides (CLI flags);
        the model id is fallback_model_name (the GGUF's name) when neither sets it."""
        values: dict[str, Any] = {
            "host": env.HOST.get(environ), "port": env.PORT.get(environ),
            "api_key": env.SPARKINFER_API_KEY.get(environ),
            "model_name": env.SPARKINFER_SERVED_MODEL_NAME.get(environ) or fallback_model_name,
            "cors_origins": env.SPARKINFER_CORS_ORIGINS.get(environ),
            "max_output_tokens": env.SPARKINFER_MAX_OUTPUT_TOKENS.get(environ),
            "read_timeout_s": env.SPARKINFER_READ_TIMEOUT_S.get(environ) or 300.0,
            "write_timeout_s": env.SPARKINFER_WRITE_TIMEOUT_S.get(environ) or 300.0,
            "request_timeout_s": env.SPARKINFER_REQUEST_TIMEOUT_S.get(environ),
            "shutdown_grace_s": env.SPARKINFER_SHUTDOWN_GRACE_S.get(environ),
        }
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown ServerConfig fields: {', '.join(sorted(unknown))}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def build_engine_config(ctx: int | None, trained_context_length: int,
                        environ: Mapping[str, str] | None = None, *, device: str = "cpu",
                        **overrides: Any) -> EngineConfig:
    """EngineConfig from --ctx (else CTX; unset or 0 = the model's trained context length, as the
    README and the seed's CTX=0 say) and the scheduler/admission variables of the environment;
    device picks the step budget's default.

    NOTE: a request reserves KV for prompt + max_tokens, and an omitted max_tokens is as many as
    fit (up to SPARKINFER_MAX_OUTPUT_TOKENS): a pool barely larger than that cap serves such
    requests one at a time, so the default is the model's full context, not a small pool."""
    ctx = env.CTX.get(environ) if ctx is None else ctx
    ctx = ctx or trained_context_length
    values: dict[str, Any] = {
        "ctx": ctx,
        "max_batch_tokens": env.SPARKINFER_BATCH_TOKENS.get(environ),
        "step_tokens": env.SPARKINFER_STEP_TOKENS.get(environ) or DEFAULT_STEP_TOKENS[device],
        "sched_policy": env.SPARKINFER_SCHED_POLICY.get(environ),
        "prefill_chunk_tokens": env.SPARKINFER_PREFILL_CHUNK_TOKENS.get(environ),
        "prefill_mix_max": env.SPARKINFER_PREFILL_MIX_MAX.get(environ),
        "prefill_batched": env.SPARKINFER_PREFILL_BATCHED.get(environ),
        "max_queue_depth": env.SPARKINFER_MAX_QUEUE_DEPTH.get(environ),
        "max_output_tokens": env.SPARKINFER_MAX_OUTPUT_TOKENS.get(environ),
        "request_timeout_s": env.SPARKINFER_REQUEST_TIMEOUT_S.get(environ),
        "decode_steps": env.SPARKINFER_DECODE_STEPS.get(environ),
        "prefix_token_ids": env.prefix_token_ids(environ),
        "prefix_cache": env.SPARKINFER_PREFIX_CACHE.get(environ),
        "prefix_snapshots": env.SPARKINFER_PREFIX_CACHE_SNAPSHOTS.get(environ),
        "spec_tokens": env.SPARKINFER_SPEC_TOKENS.get(environ),
        "step_trace": env.SPARKINFER_STEP_TRACE.get(environ),
    }
    values.update(overrides)
    return EngineConfig(**values)


# draft sources: prompt lookup, a draft model (--model-draft), the model's own MTP head
SPEC_TYPES = ("ngram", "draft", "mtp")
SPEC_TYPE_ALIASES = {"draft-mtp": "mtp",  # llama-server's name
                     "draft_model": "draft"}  # vLLM's --speculative-config method
DEFAULT_SPEC_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class Speculation:
    tokens: int  # EngineConfig.spec_tokens: the most tokens a decode step drafts
    draft_model: str | None = None  # the draft model's GGUF (or demo name); with mtp: a head's
    mtp: bool = False  # drafts from an MTP head: the model's, else draft_model's head-only file


def speculation_from_flags(spec_type: str | None, draft_n_max: int | None,
                           speculative_config: str | None,
                           model_draft: str | None = None) -> Speculation | None:
    """The speculation asked for in llama-server's spelling (--spec-type, --spec-draft-n-max,
    --model-draft: a draft model alone implies --spec-type draft) or vLLM's (--speculative-config
    '{"method": "ngram" | "mtp" | "draft_model", "model": FILE, "num_speculative_tokens": K}');
    None when none is given (the environment decides). ValueError naming the flag otherwise."""
    if speculative_config is not None:
        if spec_type is not None or draft_n_max is not None or model_draft is not None:
            raise ValueError("give --speculative-config or --spec-type / --spec-draft-n-max / "
                             "--model-draft, not both")
        spec_type, draft_n_max, model_draft = _vllm_speculation(speculative_config)
    elif spec_type is None:
        if model_draft is None:
            if draft_n_max is not None:
                raise ValueError("--spec-draft-n-max needs --spec-type")
            return None
        spec_type = "draft"
    spec_type = "mtp" if spec_type.endswith("_mtp") else \
        SPEC_TYPE_ALIASES.get(spec_type, spec_type)  # vLLM's per-model MTP methods too
    if spec_type not in SPEC_TYPES:
        raise ValueError(f"speculative method {spec_type!r} is not supported; the engine has: "
                         f"{', '.join(SPEC_TYPES)}")
    if spec_type == "draft" and model_draft is None:
        raise ValueError("--spec-type draft needs --model-draft FILE")
    if spec_type == "ngram" and model_draft is not None:
        raise ValueError("--model-draft FILE goes with --spec-type draft (a draft model) or mtp "
                         "(a head-only MTP file)")
    tokens = DEFAULT_SPEC_DRAFT_TOKENS if draft_n_max is None else draft_n_max
    if not 1 <= tokens <= MAX_SPEC_TOKENS:
        raise ValueError(f"draft tokens must be 1 to {MAX_SPEC_TOKENS}, got {tokens}")
    return Speculation(tokens, model_draft, spec_type == "mtp")


def _vllm_speculation(text: str) -> tuple[str, int, str | None]:
    """(spec type, draft tokens, draft model) of vLLM's --speculative-config JSON."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is no JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("--speculative-config must be a JSON object")
    model = config.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("--speculative-config: model must be a file name")
    method = config.get("method", "draft_model" if model is not None else None)
    if not isinstance(method, str):
        raise ValueError("--speculative-config needs a method: ngram or draft_model (with "
                         "its model)")
    tokens = config.get("num_speculative_tokens", DEFAULT_SPEC_DRAFT_TOKENS)
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        raise ValueError("--speculative-config: num_speculative_tokens must be an integer")
    return method, tokens, model
