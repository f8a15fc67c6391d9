"""`sparkinfer generate`: resolve and load the model, stream the answer, report speeds."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from rich.console import Console

from sparkinfer_cli.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    model: str | None
    raw: bool
    system: str | None
    enable_thinking: bool
    params: SamplingParams
    device: str


def run_generate(req: GenerateRequest, err: Console) -> None:
    """Generated text to stdout as it comes, everything else to stderr. Ctrl-C stops cleanly."""
    from sparkinfer_cli.generate import GenerationStats, build_prompt, stream_generation
    from sparkinfer_cli.hub import resolve_model
    from sparkinfer_cli.model.loader import load_runtime_model
    from sparkinfer_cli.preflight import check_context, check_model_file

    path, note = resolve_model(req.model, prefer_gpu=req.device == "cuda")
    if note:
        err.print(f"[yellow]{note}[/]")
    checked = check_model_file(path)  # the file, tokenizer and prompt before the weights load
    tokenizer = checked.tokenizer
    ids = build_prompt(tokenizer, req.prompt, raw=req.raw, system=req.system,
                       enable_thinking=req.enable_thinking)
    check_context(checked.config, len(ids), req.params.max_tokens)
    model = load_runtime_model(checked.gguf, req.device)
    stats = GenerationStats()
    stream = stream_generation(model, tokenizer, ids, req.params, stats)
    try:
        for text in stream:
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stream.close()
        err.print("\n[yellow]stopped[/]")
        return
    sys.stdout.write("\n")
    err.print(f"[dim]{path.name} on {req.device}: prompt {stats.prompt_tokens} tokens at "
              f"{stats.prompt_tok_s:.1f} tok/s, {stats.output_tokens} tokens at "
              f"{stats.decode_tok_s:.1f} tok/s ({stats.finish_reason})[/]")
