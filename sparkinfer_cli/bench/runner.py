"""`sparkinfer bench`: prefill, batch-1 decode and concurrent-decode throughput of one model on
one device, each against its roofline; results under the user's data directory or --out
(report.py), never over an earlier run's files.

Split by concern: measure.py times the figures, roofline.py knows the machine's peaks
and what a pass must move, report.py writes md + json + png.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from sparkinfer_cli.bench.measure import (
    DepthBench,
    Measurement,
    Settings,
    measure_throughput,
    throughput_max_tokens,
)
from sparkinfer_cli.bench.report import (
    TABLE_HEADER,
    BenchReport,
    ResultRow,
    table_cells,
    write_report,
)
from sparkinfer_cli.bench.roofline import MachinePeaks, ModelCost, machine_peaks, roofline
from sparkinfer_cli.paths import bench_results_dir

if TYPE_CHECKING:
    from sparkinfer_cli.gguf.reader import GGUFFile
    from sparkinfer_cli.model.base import CausalLM
    from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

DEVICES = ("cpu", "cuda")
DEFAULT_CTX = {"cuda": (512, 4096, 16384, 32768), "cpu": (64, 512)}  # a 2-core CPU can't do 32k
DEFAULT_CONCURRENCY = {"cuda": (1, 8, 32, 64), "cpu": (1, 4)}
SETTINGS = {
    "cuda": Settings(decode_steps=64, prefill_chunk_tokens=4096, throughput_prompt_tokens=128),
    "cpu": Settings(decode_steps=16, prefill_chunk_tokens=512, throughput_prompt_tokens=16),
}


@dataclass(frozen=True)
class BenchRequest:
    model: str | None  # path, demo name or hub ref (None with no synthetic: the default model)
    synthetic: str | None  # preset of sparkinfer_cli.gguf.synthetic, written on first use
    device: str  # cpu | cuda
    ctx: tuple[int, ...] = ()  # prefill sizes = decode depths (empty: the device's defaults)
    concurrency: tuple[int, ...] = ()  # concurrent sequences (empty: the device's defaults)
    out_dir: Path = field(default_factory=bench_results_dir)
    command: str = "sparkinfer bench"
    llama_bench: Path | None = None  # a built llama-bench: llama.cpp measured in the same run

    def __post_init__(self) -> None:
        from sparkinfer_cli.gguf.synthetic import resolve_preset

        if self.llama_bench is not None and not self.llama_bench.is_file():
            raise ValueError(f"--llama-bench {self.llama_bench}: no such file")

        if self.model is not None and self.synthetic is not None:
            raise ValueError("give a model (-m) or a synthetic preset (--synthetic), not both")
        if self.synthetic is not None:
            resolve_preset(self.synthetic)  # ValueError naming the known presets
        if self.device not in DEVICES:
            raise ValueError(f"bench runs on one of {', '.join(DEVICES)}, not {self.device!r}")
        if any(c < 1 for c in self.ctx):
            raise ValueError(f"--ctx values must be at least 1 token, got {list(self.ctx)}")
        if any(n < 1 for n in self.concurrency):
            raise ValueError(f"--concurrency values must be at least 1, "
                             f"got {list(self.concurrency)}")

    @property
    def ctx_values(self) -> tuple[int, ...]:
        return self.ctx or DEFAULT_CTX[self.device]

    @property
    def concurrency_values(self) -> tuple[int, ...]:
        return self.concurrency or DEFAULT_CONCURRENCY[self.device]

    @property
    def settings(self) -> Settings:
        return SETTINGS[self.device]


def run_bench(request: BenchRequest, console: Console) -> list[Path]:
    """Measures, prints a table, writes the result files and returns their paths."""
    from sparkinfer_cli.gguf.reader import GGUFFile
    from sparkinfer_cli.gguf.synthetic import resolve_preset
    from sparkinfer_cli.model.config import ModelConfig

    if request.synthetic is not None:  # NOTE: before writing a file of up to 22 GB
        check_fits(request, resolve_preset(request.synthetic).context_length)
    path, label = resolve_bench_model(request, console)
    gguf = GGUFFile(path)
    config = ModelConfig.from_gguf(gguf)
    check_fits(request, config.context_length)
    model, tokenizer = _load(gguf, request.device, console)
    with console.status("measuring the machine's peaks"):
        peaks = machine_peaks(request.device)
    report = _new_report(request, label, path, peaks, ModelCost.from_gguf(gguf, config))
    measurements = run_measurements(request, model, tokenizer, console)
    report.load_average["after"] = list(os.getloadavg())
    report.results = [_row(m, load, report.cost, peaks) for m, load in measurements]
    if request.llama_bench is not None:
        add_llama_cpp(report, request, path, console)
    files = write_report(report, request.out_dir)
    console.print(results_table(report))
    for note in report.notes:
        console.print(f"[yellow]{note}[/]")
    console.print("wrote " + ", ".join(str(f) for f in files))
    return files


def add_llama_cpp(report: BenchReport, request: BenchRequest, path: Path,
                  console: Console) -> None:
    """llama.cpp on the same file, machine and depths (after ours: the two never share the
    machine); a failure is a note, and the report falls back to the stored figures."""
    from sparkinfer_cli.bench.llama_bench import measure_llama_cpp

    assert request.llama_bench is not None
    with console.status("llama.cpp on the same file (llama-bench)"):
        try:
            report.llama_cpp = measure_llama_cpp(request.llama_bench, path, request.ctx_values,
                                                 request.settings.decode_steps, request.device)
        except RuntimeError as exc:
            report.notes.append(f"no llama.cpp figures from this run: {exc}")


def check_fits(request: BenchRequest, limit: int) -> None:
    """Refuses depths and concurrent requests a context of `limit` tokens cannot hold."""
    s = request.settings
    for c in request.ctx_values:
        if c + s.decode_steps > limit:
            raise ValueError(f"--ctx {c} plus {s.decode_steps} decode steps exceeds the model's "
                             f"context of {limit} tokens")
    longest = s.throughput_prompt_tokens + throughput_max_tokens(max(request.concurrency_values), s)
    if longest > limit:
        raise ValueError(f"--concurrency {max(request.concurrency_values)} needs requests of "
                         f"{longest} tokens, more than the model's context of {limit}")


# ---- model ---------------------------------------------------------------------------------------
def synthetic_path(preset: str) -> Path:
    from sparkinfer_cli.hub.demo_models import cache_dir

    return cache_dir().parent / "synthetic" / f"{preset}.gguf"


def resolve_bench_model(request: BenchRequest, console: Console) -> tuple[Path, str]:
    """(GGUF path, the label results are filed under)."""
    from sparkinfer_cli.hub.demo_models import DEMO_MODELS
    from sparkinfer_cli.hub.download import HubError, resolve_model

    if request.synthetic is not None:
        return ensure_synthetic(request.synthetic, console), request.synthetic
    try:
        path, _ = resolve_model(request.model, prefer_gpu=request.device == "cuda",
                                announce=lambda note: console.print(f"[yellow]{note}[/]"))
    except HubError as exc:
        raise ValueError(str(exc)) from exc
    demo = next((name for name, asset in DEMO_MODELS.items() if asset.filename == path.name), None)
    return path, demo or path.stem


def ensure_synthetic(preset: str, console: Console) -> Path:
    from sparkinfer_cli.gguf.synthetic import write_synthetic

    path = synthetic_path(preset)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with Progress(TextColumn("writing {task.description}"), BarColumn(), DownloadColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(path.name, total=None)
        write_synthetic(path, preset, progress=lambda done, total: progress.update(
            task, completed=done, total=total))
    return path


def _load(gguf: GGUFFile, device: str, console: Console) -> tuple[CausalLM, Tokenizer]:
    from sparkinfer_cli.model.loader import load_runtime_model
    from sparkinfer_cli.tokenizer.vocab_override import load_tokenizer

    start = time.perf_counter()
    with console.status(f"loading {gguf.path.name} on {device}"):
        loaded = load_runtime_model(gguf, device), load_tokenizer(gguf)
    console.print(f"loaded {gguf.path.name} on {device} in {time.perf_counter() - start:.0f} s")
    return loaded


# ---- measuring -----------------------------------------------------------------------------------
Measured = tuple[Measurement, float]  # (figure, 1-minute load average right after it)
Timed = Callable[[str, Callable[[], Measurement]], Measured]


def run_measurements(request: BenchRequest, model: CausalLM, tokenizer: Tokenizer,
                     console: Console) -> list[Measured]:
    """Warm-up, then prefill + decode at each ctx, then throughput at each concurrency."""
    num_figures = 2 * len(request.ctx_values) + len(request.concurrency_values)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("warm-up", total=num_figures)

        def timed(label: str, measure: Callable[[], Measurement]) -> Measured:
            progress.update(task, description=label)
            start = time.perf_counter()
            result = measure()
            progress.advance(task)
            # a line per figure: logs of runs that are cut short still show what was measured
            progress.console.print(f"{label}: {result.tok_s:,.1f} tok/s "
                                   f"({time.perf_counter() - start:.0f} s)")
            return result, os.getloadavg()[0]

        results = _depth_figures(request, model, timed)
        results += [timed(f"throughput, {n} sequences",
                          partial(measure_throughput, model, tokenizer, n, request.settings))
                    for n in request.concurrency_values]
    return results


def _depth_figures(request: BenchRequest, model: CausalLM, timed: Timed) -> list[Measured]:
    """Prefill and decode at each depth (their KV cache is gone before the engine makes its own)."""
    depths = DepthBench(model, max(request.ctx_values), request.settings)
    depths.warm_up(min(request.ctx_values))
    results = []
    for c in request.ctx_values:
        results.append(timed(f"prefill {c} tokens", partial(depths.prefill, c)))
        results.append(timed(f"decode after {c} tokens", partial(depths.decode, c)))
    return results


def _row(m: Measurement, load: float, cost: ModelCost, peaks: MachinePeaks) -> ResultRow:
    fraction, bound = roofline(cost, peaks, m.tokens_per_pass, m.tok_s)
    return ResultRow(m.kind, m.ctx, m.concurrency, m.tok_s, fraction, bound, load, m.host_us)


# ---- report --------------------------------------------------------------------------------------
def _new_report(request: BenchRequest, label: str, path: Path, peaks: MachinePeaks,
                cost: ModelCost) -> BenchReport:
    return BenchReport(
        model=label, model_file=path.name, device=peaks.name, device_kind=request.device,
        commit=git_commit(), date=datetime.now().astimezone().isoformat(timespec="seconds"),
        command=request.command, peaks=peaks, cost=cost, settings=request.settings,
        load_average={"before": list(os.getloadavg())})


def git_commit() -> str:
    """HEAD's hash, "+dirty" when tracked files differ from it (the figures are not HEAD's)."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return "unknown"
    return head + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def results_table(report: BenchReport) -> Table:
    table = Table(title=f"{report.model} on {report.device}")
    for name in TABLE_HEADER:
        table.add_column(name, justify="left" if name in ("figure", "bound") else "right")
    for cells in table_cells(report):
        table.add_row(*cells)
    return table
