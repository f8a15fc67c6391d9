"""`sparkinfer generate` and `chat`: resolve and load the model while saying what takes the time,
then stream the answers and report speeds."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from sparkinfer_cli.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sparkinfer_cli.app.generate import GenerationSession, GenerationStats
    from sparkinfer_cli.app.preflight import CheckedModel
    from sparkinfer_cli.server.config import Speculation
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

EXIT_INTERRUPTED = 130  # a shell's code for a command ended by Ctrl-C (128 + SIGINT)
CHAT_CTX = 4096  # a chat's default KV cache: several turns, a few hundred MB on small models


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | None  # None: the chat starts with an empty prompt line
    model: str | None
    raw: bool
    system: str | None
    enable_thinking: bool
    params: SamplingParams
    device: str  # auto | cpu | cuda; picked by run_generate
    ctx: int | None = None  # KV cache in tokens; None: the prompt + max_tokens (chat: 4,096)
    interactive: bool = False
    speculation: Speculation | None = None  # drafts a decode step checks (None: none)


@dataclass
class Loaded:
    """A model ready to answer: its session warmed up, its tokenizer and file name; `with` it
    to stop the session's engine at the end."""
    session: GenerationSession
    tokenizer: Tokenizer
    name: str

    def __enter__(self) -> Loaded:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.session.close()


def run_generate(req: GenerateRequest, err: Console) -> int:
    """Generated text to stdout as it comes, everything else to stderr; the exit code."""
    from sparkinfer_cli.app.chat import run_chat
    from sparkinfer_cli.app.generate import GenerationStats, build_prompt
    from sparkinfer_cli.app.preflight import check_context

    req, path = _resolve(req, err)
    checked = _read(path, err)
    if req.interactive:
        with _load(req, checked, req.ctx or CHAT_CTX, err) as loaded:
            return run_chat(req, loaded, err)
    ids = build_prompt(checked.tokenizer, req.prompt or "", raw=req.raw, system=req.system,
                       enable_thinking=req.enable_thinking)
    check_context(checked.config, len(ids), req.params.max_tokens)
    check_fits(req.ctx, len(ids), req.params.max_tokens)
    stats = GenerationStats()
    with _load(req, checked, req.ctx or len(ids) + req.params.max_tokens, err) as loaded:
        _, finished = stream_answer(loaded.session.stream(ids, req.params, stats))
    if not finished:
        err.print("\n[yellow]stopped[/]")
        return EXIT_INTERRUPTED
    report_speeds(err, f"{loaded.name} on {req.device}", stats)
    return 0


def check_fits(ctx: int | None, num_prompt_tokens: int, max_tokens: int) -> None:
    if ctx is not None and num_prompt_tokens + max_tokens > ctx:
        raise ValueError(f"--max-tokens {max_tokens:,} after the prompt's {num_prompt_tokens:,} "
                         f"tokens is beyond --ctx {ctx:,}")


def _resolve(req: GenerateRequest, err: Console) -> tuple[GenerateRequest, Path]:
    """The request with its device picked ("auto" probes for a GPU), and the model's file."""
    with err.status("starting"):  # the hub client's and numba's imports take a second or two
        from sparkinfer_cli.device import pick_device
        from sparkinfer_cli.hub.download import resolve_model
        req = dataclasses.replace(req, device=pick_device(req.device))

    def announce(note: str) -> None:  # before a download, so that the user knows what comes
        err.print(f"[yellow]{escape(note)}[/]", highlight=False)

    path, _ = resolve_model(req.model, prefer_gpu=req.device == "cuda", announce=announce)
    if req.speculation is not None and req.speculation.draft_model is not None:
        draft, _ = resolve_model(req.speculation.draft_model, prefer_gpu=req.device == "cuda",
                                 announce=announce)
        req = dataclasses.replace(req, speculation=dataclasses.replace(
            req.speculation, draft_model=str(draft)))
    return req, path


def _read(path: Path, err: Console) -> CheckedModel:
    """The file, tokenizer and template checked before the weights load."""
    from sparkinfer_cli.app.preflight import check_model_file

    with err.status(f"reading {escape(path.name)}"):
        return check_model_file(path)


def _load(req: GenerateRequest, checked: CheckedModel, ctx: int, err: Console) -> Loaded:
    from sparkinfer_cli.app.generate import WARM_UP_TOKENS, GenerationSession
    from sparkinfer_cli.model.loader import load_draft_model, load_runtime_model

    ctx = min(ctx + WARM_UP_TOKENS, checked.config.context_length + WARM_UP_TOKENS)
    spec = req.speculation
    use_mtp = spec is not None and spec.mtp
    other_file = None if spec is None else spec.draft_model  # a head-only file's, with mtp
    with err.status("loading") as status:
        model = load_runtime_model(checked.gguf, req.device,
                                   report=lambda what: status.update(escape(what)),
                                   with_mtp=use_mtp, mtp_file=other_file if use_mtp else None)
        draft = None if use_mtp or not other_file else \
            load_draft_model(other_file, checked.gguf, req.device,
                             report=lambda what: status.update(escape(what)))
        status.update("starting the engine")
        session = GenerationSession(model, checked.tokenizer, ctx,
                                    0 if spec is None else spec.tokens, draft, use_mtp)
        cold = req.device == "cpu" and not cpu_kernels_are_cached()
        status.update("compiling the kernels (first run only: numba caches them)" if cold
                      else "warming up")
        started = time.monotonic()
        session.warm_up(req.params)
    if cold:
        err.print(f"[dim]compiled the kernels in {time.monotonic() - started:.0f} s; later runs "
                  "load them from numba's cache[/]")
    return Loaded(session, checked.tokenizer, checked.gguf.path.name)


def cpu_kernels_are_cached() -> bool:
    """Whether numba's cache holds the CPU kernels (cold, a first run compiles them for tens of
    seconds). Judged by one kernel every pass calls."""
    from sparkinfer_cli.kernels.cpu.decode_ops import _rms_norm_rows
    try:
        return Path(_rms_norm_rows._cache._cache_file._index_path).is_file()
    except AttributeError:  # numba's cache internals moved: assume warm, say "warming up"
        return True


def stream_answer(stream: Generator[str, None, None]) -> tuple[str, bool]:
    """Writes the text to stdout as it comes; (the text, False when Ctrl-C stopped it)."""
    parts = []
    try:
        for text in stream:
            parts.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stream.close()
        return "".join(parts), False
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts), True


def report_speeds(err: Console, what: str, stats: GenerationStats) -> None:
    cached = f" ({stats.cached_tokens} cached)" if stats.cached_tokens else ""
    drafts = stats.drafts
    kept = f"; drafts: {drafts.num_accepted_tokens} of {drafts.num_draft_tokens} kept, " \
        f"{drafts.mean_accepted_length:.2f} tokens a check" if drafts else ""
    err.print(f"[dim]{escape(what)}: prompt {stats.prompt_tokens} tokens{cached} at "
              f"{stats.prompt_tok_s:.1f} tok/s, {stats.output_tokens} tokens at "
              f"{stats.decode_tok_s:.1f} tok/s ({stats.finish_reason}){kept}[/]",
              highlight=False)
