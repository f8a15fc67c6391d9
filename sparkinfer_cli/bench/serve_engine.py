"""The engine-only figure beside `sparkinfer bench --serve`'s: bench.measure's decode throughput
at each concurrency, for the serving run's prompt and output lengths, in a process of its own (so
the model's memory is gone before or after the server holds its copy).

    python -m sparkinfer_cli.bench.serve_engine MODEL.gguf DEVICE PROMPT_TOKENS MAX_TOKENS N...

prints one JSON line: {"device": description, "figures": {N: {"tok_s", "max_tokens"}}}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from sparkinfer_cli.bench.measure import (
    WINDOW_SKIP_STEPS,
    Settings,
    measure_throughput,
    throughput_max_tokens,
)
from sparkinfer_cli.bench.roofline import cpu_info
from sparkinfer_cli.bench.runner import SETTINGS


def engine_settings(device: str, prompt_tokens: int, max_tokens: int, concurrency: int) -> Settings:
    """Settings whose throughput requests are max_tokens long where they can be (the window in
    which all decode needs at least one step beyond the concurrency's ramp)."""
    decode_steps = max(1, max_tokens - concurrency - WINDOW_SKIP_STEPS)
    return Settings(decode_steps=decode_steps,
                    prefill_chunk_tokens=SETTINGS[device].prefill_chunk_tokens,
                    throughput_prompt_tokens=prompt_tokens)


def describe_device(device: str) -> str:
    if device == "cuda":
        from sparkinfer_cli.bench.roofline import gpu_name

        return gpu_name()
    return f"{cpu_info()['model name']}, {len(os.sched_getaffinity(0))} cores"


def engine_figures(path: Path, device: str, prompt_tokens: int, max_tokens: int,
                   concurrencies: list[int]) -> dict:
    from sparkinfer_cli.gguf.reader import GGUFFile
    from sparkinfer_cli.model.loader import load_runtime_model
    from sparkinfer_cli.tokenizer.vocab_override import load_tokenizer

    gguf = GGUFFile(path)
    model, tokenizer = load_runtime_model(gguf, device), load_tokenizer(gguf)
    figures = {}
    for n in concurrencies:
        settings = engine_settings(device, prompt_tokens, max_tokens, n)
        # NOTE: a short throwaway run first, as the serving side has its warm-up round
        measure_throughput(model, tokenizer, n, engine_settings(device, prompt_tokens, 1, n))
        tok_s = measure_throughput(model, tokenizer, n, settings).tok_s
        figures[n] = {"tok_s": tok_s, "max_tokens": throughput_max_tokens(n, settings)}
        print(f"engine only, {n} sequences: {tok_s:,.1f} tok/s", file=sys.stderr, flush=True)
    return {"device": describe_device(device), "figures": figures}


def main(argv: list[str]) -> None:
    path, device, prompt_tokens, max_tokens, *concurrencies = argv
    result = engine_figures(Path(path), device, int(prompt_tokens), int(max_tokens),
                            [int(n) for n in concurrencies])
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
