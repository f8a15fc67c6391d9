"""What `generate` and `serve` check before the weights load, so that a bad file, flag or address
fails in a second with one line instead of after minutes of loading (or with a traceback).

The file: header, metadata, tensor table and tokenizer (a GGUFError naming the file). The flags:
the prompt and --max-tokens against the model's context; the server's address and its KV pool
against the memory there is.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sparkinfer_cli import env
from sparkinfer_cli.gguf.reader import GGUFError, GGUFFile
from sparkinfer_cli.kv_budget import DraftFit, KVPool, fit_kv_pool
from sparkinfer_cli.model.config import ModelConfig
from sparkinfer_cli.model.loader import check_draft_model, checked_config, mtp_tensors
from sparkinfer_cli.server.config import Speculation, build_engine_config
from sparkinfer_cli.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer
from sparkinfer_cli.tokenizer.vocab_override import load_tokenizer


@dataclass(frozen=True)
class CheckedModel:
    """A file that passed every check short of reading its weights."""
    gguf: GGUFFile
    config: ModelConfig
    tokenizer: Tokenizer


def check_model_file(path: str | Path, environ: Mapping[str, str] | None = None) -> CheckedModel:
    return check_loadable(GGUFFile(path), environ)


def check_loadable(gguf: GGUFFile, environ: Mapping[str, str] | None = None) -> CheckedModel:
    """GGUFError naming the file unless its config, tensor table, tokenizer and chat template
    are what loading and serving need."""
    config = checked_config(gguf)
    tokenizer = load_tokenizer(gguf, environ)
    if tokenizer.vocab_size > config.n_vocab:  # token ids index the embedding's rows
        raise GGUFError(f"{gguf.path}: the tokenizer has {tokenizer.vocab_size} tokens, the "
                        f"model's embedding {config.n_vocab} rows")
    try:
        ChatTemplate.from_tokenizer(tokenizer)  # the server compiles it only after loading
    except ChatTemplateError as exc:
        raise GGUFError(f"{gguf.path}: {exc}") from None
    return CheckedModel(gguf, config, tokenizer)


def check_context(config: ModelConfig, num_prompt_tokens: int, max_tokens: int) -> None:
    if num_prompt_tokens + max_tokens > config.context_length:
        raise ValueError(f"--max-tokens {max_tokens:,} after the prompt's {num_prompt_tokens:,} "
                         f"tokens is beyond the model's context of {config.context_length:,} "
                         "tokens")


def check_serve(path: str | Path, host: str | None, port: int | None, ctx: int | None,
                device: str, environ: Mapping[str, str] | None = None,
                speculation: Speculation | None = None) -> KVPool:
    """The server's KV pool (--ctx to use, and a note if it was capped), once the address is free
    and the file (and a draft model's) loadable; speculation: the flags' (None: the
    environment's)."""
    check_address(host or env.HOST.get(environ), env.PORT.get(environ) if port is None else port)
    checked = check_model_file(path, environ)
    draft = None
    if speculation is not None and speculation.mtp:
        draft = check_mtp(checked, speculation.draft_model)
    elif speculation is not None and speculation.draft_model is not None:
        draft = check_draft_file(speculation.draft_model, checked.gguf)
    pool = fit_kv_pool(checked.config, ctx, device, checked.gguf.n_bytes, environ,
                       None if speculation is None else speculation.tokens, draft)
    # as run_server builds it after loading: a bad --ctx or SPARKINFER_* setting fails now
    build_engine_config(pool.ctx, checked.config.context_length, environ, device=device)
    return pool


def check_draft_file(path: str | Path, target: GGUFFile) -> DraftFit:
    """What a draft model adds to the server's memory, once its file can draft for target's."""
    try:
        draft = GGUFFile(path)
    except GGUFError as exc:
        raise ValueError(f"--model-draft: {exc}") from None
    return DraftFit(check_draft_model(draft, target), draft.n_bytes)


def check_mtp(checked: CheckedModel, head_file: str | Path | None) -> DraftFit:
    """--spec-type mtp needs an MTP head, the model file's or head_file's; what it adds to the
    server's memory: its layer's KV (as many tokens as the pool) and a head-only file's weights
    (the model file's bytes already hold its own head's)."""
    try:
        mtp_tensors(checked.gguf, checked.config, head_file)
    except ValueError as exc:
        raise ValueError(f"--spec-type mtp: {exc}") from None
    return DraftFit(checked.config.mtp_head_config(),
                    GGUFFile(head_file).n_bytes if head_file is not None else 0)


def check_address(host: str, port: int) -> None:
    """Refuse an address the server could not listen on (port 0 picks a free one)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    if port == 0:
        return
    with socket.socket(family, kind, proto) as probe:
        # as the server binds: a port left in TIME_WAIT is free, one with a listener is not
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            reason = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise ValueError(f"cannot listen on {host}:{port} (--host / --port): "
                             f"{reason}") from None
