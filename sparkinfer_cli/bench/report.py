"""What `sparkinfer bench` writes: <date>-<model>-<device>.json, .md (with llama.cpp's figures for
the same model and machine where we have them) and a .png chart (when matplotlib is importable)."""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from sparkinfer_cli.bench.measure import WINDOW_SKIP_STEPS, Settings
from sparkinfer_cli.bench.roofline import MachinePeaks, ModelCost

KINDS = ("prefill", "decode", "throughput")


@dataclass(frozen=True)
class Anchor:
    """A llama.cpp figure comparable to our (kind, ctx) row."""

    kind: str
    ctx: int
    tok_s: float
    test: str  # llama-bench's name for it


CPU_ANCHOR_SOURCE = ("llama-bench -t 2, llama.cpp 0c1e57098 CPU build, 2-core AMD EPYC "
                     "(tests/fixtures/real/llama_bench_qwen25coder.json)")
H200_ANCHOR_SOURCE = ("llama-bench -ngl 99, flash-attn on, KV f16, llama.cpp 0c1e57098 on one H200 "
                      "(shared/anchors/llamacpp-h200.md)")
# (model, device) → (source, figures); decode "after 0 tokens" is set against our shallowest depth
LLAMA_CPP_ANCHORS: dict[tuple[str, str], tuple[str, tuple[Anchor, ...]]] = {
    ("qwen2.5-coder-0.5b", "cpu"): (CPU_ANCHOR_SOURCE, (
        Anchor("prefill", 64, 124.3, "pp64"), Anchor("decode", 64, 32.2, "tg32"))),
    ("qwen3.6-35b-a3b", "cuda"): (H200_ANCHOR_SOURCE, (
        Anchor("prefill", 512, 5740, "pp512"), Anchor("prefill", 4096, 5614, "pp4096"),
        Anchor("decode", 512, 225, "tg128"), Anchor("decode", 4096, 228, "tg128 @ d4096"),
        Anchor("decode", 32768, 204, "tg128 @ d32768"))),
    ("qwen3-30b-a3b", "cuda"): (H200_ANCHOR_SOURCE, (
        Anchor("prefill", 512, 10600, "pp512"), Anchor("prefill", 4096, 9981, "pp4096"),
        Anchor("decode", 512, 302, "tg128"), Anchor("decode", 4096, 256, "tg128 @ d4096"),
        Anchor("decode", 32768, 211, "tg128 @ d32768"))),
}


@dataclass(frozen=True)
class ResultRow:
    kind: str
    ctx: int
    concurrency: int
    tok_s: float
    roofline_fraction: float
    bound: str  # memory | compute: the roof the fraction is taken against
    load_1min: float  # the machine's 1-minute load average right after the figure was taken
    host_us: float | None = None  # decode: host µs a step until its GPU work is queued


@dataclass
class BenchReport:
    model: str  # label: demo name, synthetic preset or file stem
    model_file: str
    device: str  # GPU name or CPU model
    device_kind: str  # cpu | cuda
    commit: str
    date: str  # ISO 8601, local time
    command: str
    peaks: MachinePeaks
    cost: ModelCost
    settings: Settings
    load_average: dict[str, list[float]]  # before / after: 1, 5, 15-minute load averages
    results: list[ResultRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # llama.cpp measured in this run (--llama-bench): (how, figures); None: the stored anchors
    llama_cpp: tuple[str, tuple[Anchor, ...]] | None = None

    @property
    def stem(self) -> str:
        return result_stem(self.date, self.model, self.device_kind)

    def baseline(self) -> tuple[str, tuple[Anchor, ...]]:
        """(source, figures) of llama.cpp: measured in this run, else stored for this model and
        device (another machine's, at another time), else none."""
        return self.llama_cpp or LLAMA_CPP_ANCHORS.get((self.model, self.device_kind), ("", ()))

    def anchors(self) -> list[tuple[Anchor, ResultRow]]:
        _, figures = self.baseline()
        return [(a, r) for a in figures for r in self.results if (r.kind, r.ctx) == (a.kind, a.ctx)]


def result_stem(date: str, model: str, device_kind: str) -> str:
    """<date>-<model>-<device>: the name every bench result file starts with."""
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", model)
    return f"{date[:10]}-{label}-{device_kind}"


def free_stem(out_dir: Path, stem: str, date: str) -> str:
    """`stem`, or stem-HHMMSS (the run's time, then -2, -3, ...) when an earlier run's files
    already have it: no run overwrites another's."""
    def taken(name: str) -> bool:
        return any(out_dir.glob(f"{glob.escape(name)}.*"))

    clock = date[11:19].replace(":", "")  # "" when the date has no time
    timed = f"{stem}-{clock}" if clock else stem
    candidates = itertools.chain([stem, timed], (f"{timed}-{i}" for i in itertools.count(2)))
    return next(name for name in candidates if not taken(name))


def write_report(report: BenchReport, out_dir: Path) -> list[Path]:
    """Writes the chart (if it can), the JSON and the markdown; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = free_stem(out_dir, report.stem, report.date)
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    chart = write_chart(report, out_dir / f"{stem}.png")  # NOTE: first: it may add a note
    js.write_text(json.dumps(report_json(report, chart), indent=2) + "\n")
    md.write_text(report_markdown(report, chart))
    return [md, js] + ([chart] if chart else [])


def report_json(report: BenchReport, chart: Path | None) -> dict:
    source, _ = report.baseline()
    return {
        "model": report.model, "model_file": report.model_file, "device": report.device,
        "device_kind": report.device_kind, "commit": report.commit, "date": report.date,
        "command": report.command,
        "machine": dataclasses.asdict(report.peaks) | {"load_average": report.load_average},
        "model_cost": dataclasses.asdict(report.cost) | {
            "active_params": report.cost.active_params,
            "decode_bytes_per_token": report.cost.bytes_per_pass(1)},
        "settings": dataclasses.asdict(report.settings),
        "results": [dataclasses.asdict(r) for r in report.results],
        "llama_cpp": [{"kind": a.kind, "ctx": a.ctx, "test": a.test, "tok_s": a.tok_s,
                       "ratio": r.tok_s / a.tok_s, "source": source} for a, r in report.anchors()],
        "chart": chart.name if chart else None,
        "notes": report.notes,
    }


# ---- markdown ------------------------------------------------------------------------------------
def report_markdown(report: BenchReport, chart: Path | None) -> str:
    lines = [f"# sparkinfer bench: {report.model} on {report.device_kind}", "",
             *_header_lines(report), "", *_table_lines(report), "", *_method_lines(report)]
    lines += ["", f"![chart]({chart.name})" if chart else "No chart (see notes)."]
    if report.notes:
        lines += ["", "Notes:", *(f"- {note}" for note in report.notes)]
    return "\n".join(lines) + "\n"


def _header_lines(report: BenchReport) -> list[str]:
    peaks, cost, load = report.peaks, report.cost, report.load_average
    return [
        f"- date: {report.date}; commit `{report.commit}`",
        f"- command: `{report.command}`",
        f"- model: {report.model} (`{report.model_file}`), {cost.active_params / 1e6:.1f} M active "
        f"params, {cost.bytes_per_pass(1) / 1e6:.1f} MB of weights read per decoded token",
        f"- machine: {peaks.name}; memory bandwidth {peaks.memory_bandwidth / 1e9:.1f} GB/s, "
        f"peak {peaks.peak_flops / 1e12:.3g} TFLOP/s ({peaks.note})",
        f"- load average (1/5/15 min) before: {_load(load['before'])}, "
        f"after: {_load(load['after'])}; the load column is the 1-minute average after each figure "
        f"(a shared machine: the figures move with it)",
    ]


def _load(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


TABLE_HEADER = ("figure", "ctx", "concurrency", "tok/s", "roofline", "bound", "load",
                "host µs/step", "llama.cpp", "ratio")


def table_cells(report: BenchReport) -> list[tuple[str, ...]]:
    """One row of TABLE_HEADER cells per result (the markdown and the console show the same)."""
    anchored = {(r.kind, r.ctx, r.concurrency): a for a, r in report.anchors()}
    cells: list[tuple[str, ...]] = []
    for r in report.results:
        a = anchored.get((r.kind, r.ctx, r.concurrency))
        ref = (f"{a.tok_s:,.1f} ({a.test})", f"{r.tok_s / a.tok_s:.2f}×") if a else ("—", "—")
        host = "—" if r.host_us is None else f"{r.host_us:,.0f}"
        cells.append((r.kind, str(r.ctx), str(r.concurrency), f"{r.tok_s:,.1f}",
                      percent(r.roofline_fraction), r.bound, f"{r.load_1min:.1f}", host, *ref))
    return cells


def _table_lines(report: BenchReport) -> list[str]:
    align = ["---" if name in ("figure", "bound") else "---:" for name in TABLE_HEADER]
    rows = [TABLE_HEADER, align, *table_cells(report)]
    return ["| " + " | ".join(row) + " |" for row in rows]


def percent(fraction: float) -> str:
    """12 % → "12%", 0.0637 % → "0.064%": two significant digits below 10 %."""
    value = 100 * fraction
    return f"{value:.0f}%" if value >= 10 else f"{value:.2g}%"


def _method_lines(report: BenchReport) -> list[str]:
    s = report.settings
    source, _ = report.baseline()
    lines = [
        f"Method: prompts are random token ids (seed {s.seed}); kernels warmed up first. "
        f"prefill: the ctx-token prompt in pieces of ≤ {s.prefill_chunk_tokens} tokens (median "
        f"of ≤ 3 runs). "
        f"decode: batch 1 after ctx tokens, median over {s.decode_steps} steps (where the "
        f"backend picks greedy ids on the device: runs of passes queued at once, each fed the "
        f"previous pass's id, as the engine serves greedy requests, time a step = a run's / its "
        f"passes; else one forward of a random id a step returning the logits; host µs/step: "
        f"the part of a step spent on the host before its GPU work is queued, where the backend "
        f"counts it). throughput: N greedy requests of "
        f"{s.throughput_prompt_tokens} prompt tokens through the ContinuousBatchEngine; output "
        f"tokens/s while all N decode together ({s.decode_steps} steps, after "
        f"{WINDOW_SKIP_STEPS} settling steps).",
        "Roofline: floor = max(weight bytes read per pass / bandwidth, 2 × active params × tokens "
        "/ peak FLOPs) over the measured time; MoE counts the routed experts the pass's tokens "
        "are expected to touch (n_expert_used of n_expert per token); KV-cache reads and "
        "attention FLOPs are not counted.",
    ]
    if source:
        depth_note = "" if report.llama_cpp else " Its tg figures without `@ d` are decoded " \
            "from depth 0 and set against our shallowest depth."
        lines.append(f"llama.cpp: {source}; ratio = ours / llama.cpp.{depth_note}")
    return lines


# ---- chart ---------------------------------------------------------------------------------------
def write_chart(report: BenchReport, path: Path) -> Path | None:
    """Bar charts of tok/s per kind, labelled with the roofline fraction; None if not drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        report.notes.append("PNG skipped: matplotlib is not installed; install the bench "
                            "extra to draw it: pip install -e \".[bench]\" (or pip install "
                            "matplotlib)")
        return None
    try:
        _draw(plt, report, path)
    except Exception as exc:  # NOTE: a chart problem must never cost the measured figures
        report.notes.append(f"PNG skipped: drawing the chart failed ({exc})")
        return None
    return path


def _draw(plt, report: BenchReport, path: Path) -> None:
    kinds = [k for k in KINDS if any(r.kind == k for r in report.results)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        _draw_kind(ax, report, kind)
    fig.suptitle(f"{report.model} on {report.device} ({report.date[:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _draw_kind(ax, report: BenchReport, kind: str) -> None:
    """One kind's bars (tok/s, labelled with the roofline fraction) and llama.cpp's marks."""
    rows = [r for r in report.results if r.kind == kind]
    x_of = (lambda r: r.concurrency) if kind == "throughput" else (lambda r: r.ctx)
    bars = ax.bar([str(x_of(r)) for r in rows], [r.tok_s for r in rows], color="#4477aa")
    ax.bar_label(bars, [f"{r.tok_s:,.1f}\n{percent(r.roofline_fraction)} roof" for r in rows],
                 fontsize=8)
    marks = [(rows.index(r), a.tok_s) for a, r in report.anchors() if r.kind == kind]
    if marks:
        ax.scatter(*zip(*marks), marker="_", s=900, color="#cc3311", zorder=3, label="llama.cpp")
        ax.legend(fontsize=8, loc="upper right")
    ax.set_title(kind)
    ax.set_xlabel("concurrent sequences" if kind == "throughput" else "ctx (tokens)")
    ax.set_ylabel("tok/s")
    ax.margins(y=0.25)
