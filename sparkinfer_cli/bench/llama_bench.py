"""llama.cpp's figures measured in the same run (`sparkinfer bench --llama-bench BIN`): a built
llama-bench on the same GGUF, the same machine and the same depths, so that a ratio in the report
never sets our figure against another machine's (lent machines of one kind differ by up to 14 %,
a shared VM's speed drifts by more).

Prefill: pp{ctx} from an empty context. Decode: tg{n} after ctx tokens (llama-bench's -d), our
decode rows' depth. On CUDA every layer is offloaded and flash attention is on.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from sparkinfer_cli.bench.report import Anchor

LLAMA_BENCH_TIMEOUT_S = 3600.0
REPEATS = 3


def llama_bench_args(binary: Path, model_file: Path, device: str) -> list[str]:
    """The arguments every run shares: the model, the repeats, the device's settings, JSON out."""
    device_args = ["-ngl", "99", "-fa", "on"] if device == "cuda" else \
        ["-ngl", "0", "-t", str(os.cpu_count() or 1)]
    return [str(binary), "-m", str(model_file), "-r", str(REPEATS), *device_args, "-o", "json"]


def measure_llama_cpp(binary: Path, model_file: Path, ctxs: Sequence[int], decode_tokens: int,
                      device: str) -> tuple[str, tuple[Anchor, ...]]:
    """(how they were measured, the anchors): prefill at each ctx, decode_tokens of decode
    after each ctx. RuntimeError with llama-bench's last line when it fails."""
    base = llama_bench_args(binary, model_file, device)
    depths = ",".join(str(c) for c in ctxs)
    runs = [[*base, "-p", depths, "-n", "0"],
            [*base, "-p", "0", "-n", str(decode_tokens), "-d", depths]]
    anchors = [anchor for args in runs for anchor in anchors_of(run_llama_bench(args))]
    command = " ; ".join(" ".join(args) for args in runs)
    return f"measured in this run: {command}", tuple(anchors)


def run_llama_bench(args: list[str]) -> list[dict]:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=LLAMA_BENCH_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"llama-bench did not run: {exc}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {last}")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise RuntimeError("llama-bench printed no JSON (a build without -o json?)") from None


def anchors_of(records: list[dict]) -> list[Anchor]:
    """llama-bench's JSON records as our rows' anchors: a prompt-only record is prefill at its
    prompt length, a generation record decode at its depth."""
    anchors = []
    for r in records:
        if r.get("n_gen", 0) == 0:
            anchors.append(Anchor("prefill", int(r["n_prompt"]), float(r["avg_ts"]),
                                  f"pp{r['n_prompt']}"))
        else:
            depth = int(r.get("n_depth", 0))
            test = f"tg{r['n_gen']}" + (f" @ d{depth}" if depth else "")
            anchors.append(Anchor("decode", depth, float(r["avg_ts"]), test))
    return anchors
