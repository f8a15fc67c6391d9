"""Rooflines for `sparkinfer bench`: what one forward pass must read and compute, over the machine's
peaks. A figure's roofline fraction is the pass's floor time, max(bytes / bandwidth, FLOPs / peak),
over its measured time: decode lands on the memory roof, long prefills on the compute roof.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sparkinfer_cli.gguf.reader import GGUFFile
    from sparkinfer_cli.model.config import ModelConfig

EXPERT_TENSOR = re.compile(r"_exps\.")  # routed experts (ffn_*_exps); shared experts are _shexp
BANDWIDTH_BYTES = 128 << 20  # per array: far beyond any CPU cache
BANDWIDTH_REPEATS = 10

# DESIGN.md §3, measured on the H200: copy bandwidth with wide loads, bf16 mma.sync GEMM
GPU_PEAKS = {"H200": (4.0e12, 7.9e14)}
DEFAULT_GPU = "H200"


@dataclass(frozen=True)
class MachinePeaks:
    name: str  # GPU name or CPU model
    memory_bandwidth: float  # B/s
    peak_flops: float  # FLOP/s
    note: str  # where the two figures come from


@dataclass(frozen=True)
class ModelCost:
    """Weight bytes and parameters, split into what every token uses and the routed experts."""

    dense_bytes: int
    expert_bytes: int
    dense_params: int
    expert_params: int
    n_expert: int = 0
    n_expert_used: int = 0

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, config: ModelConfig) -> ModelCost:
        sizes = {"dense_bytes": 0, "expert_bytes": 0, "dense_params": 0, "expert_params": 0}
        for info in gguf.tensors.values():
            if info.name == "token_embd.weight" and not config.tied_embeddings:
                continue  # NOTE: an untied embedding is a row lookup, not a matmul
            part = "expert" if EXPERT_TENSOR.search(info.name) else "dense"
            sizes[f"{part}_bytes"] += info.n_bytes
            sizes[f"{part}_params"] += info.n_elements
        return cls(**sizes, n_expert=config.n_expert, n_expert_used=config.n_expert_used)

    def expert_fraction(self, num_tokens: int) -> float:
        """Expected share of the experts that num_tokens tokens touch (uniform routing)."""
        if not self.n_expert:
            return 0.0
        return 1.0 - (1.0 - self.n_expert_used / self.n_expert) ** num_tokens

    def bytes_per_pass(self, num_tokens: int) -> float:
        """Weight bytes one forward pass over num_tokens tokens reads (each weight once)."""
        return self.dense_bytes + self.expert_bytes * self.expert_fraction(num_tokens)

    @property
    def active_params(self) -> float:
        used = self.n_expert_used / self.n_expert if self.n_expert else 0.0
        return self.dense_params + self.expert_params * used

    def flops_per_pass(self, num_tokens: int) -> float:
        return 2.0 * self.active_params * num_tokens


def roofline(cost: ModelCost, peaks: MachinePeaks, tokens_per_pass: int,
             tok_s: float) -> tuple[float, str]:
    """(fraction of the roofline reached, "memory" | "compute": the roof that binds)."""
    memory_s = cost.bytes_per_pass(tokens_per_pass) / peaks.memory_bandwidth
    compute_s = cost.flops_per_pass(tokens_per_pass) / peaks.peak_flops
    measured_s = tokens_per_pass / tok_s
    return max(memory_s, compute_s) / measured_s, "memory" if memory_s >= compute_s else "compute"


# ---- machine peaks -------------------------------------------------------------------------------
def machine_peaks(device: str) -> MachinePeaks:
    return gpu_peaks() if device == "cuda" else cpu_peaks()


def gpu_name() -> str:
    from numba import cuda

    name = getattr(cuda.get_current_device(), "name", "CUDA simulator")  # the simulator has none
    return name.decode() if isinstance(name, bytes) else str(name)


def gpu_peaks() -> MachinePeaks:
    name = gpu_name()
    key = next((k for k in GPU_PEAKS if k in name), None)
    bandwidth, flops = GPU_PEAKS[key or DEFAULT_GPU]
    note = "DESIGN.md §3 (H200: copy 4.0 TB/s, bf16 mma 790 TFLOP/s)"
    if key is None:
        note += f"; peaks for {name} unknown, H200 figures assumed"
    return MachinePeaks(name, bandwidth, flops, note)


@functools.cache
def cpu_peaks() -> MachinePeaks:
    info = cpu_info()
    cores = len(os.sched_getaffinity(0))
    lanes = 16 if "avx512f" in info["flags"] else 8  # fp32 lanes of one vector register
    hz = cpu_clock_hz(info)
    flops = cores * 2 * lanes * 2 * hz  # 2 FMA units per core, 2 FLOPs per FMA lane
    copy, read = measure_memory_bandwidth(cores)
    note = (f"bandwidth: the better of a numpy copy ({copy / 1e9:.1f} GB/s, read + write bytes) "
            f"and a read-only OR-reduction ({read / 1e9:.1f} GB/s) of {BANDWIDTH_BYTES >> 20} MiB "
            f"on {cores} threads, best of {BANDWIDTH_REPEATS}; FLOPs assumed = {cores} cores × "
            f"2 FMA × {lanes} fp32 lanes × 2 × {hz / 1e9:.2f} GHz")
    return MachinePeaks(info["model name"], max(copy, read), flops, note)


def cpu_info() -> dict[str, str]:
    """Fields of the first processor in /proc/cpuinfo (model name, flags, cpu MHz)."""
    fields = {"model name": "unknown CPU", "flags": "", "cpu MHz": "0"}
    path = Path("/proc/cpuinfo")
    text = path.read_text() if path.exists() else ""
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_clock_hz(info: dict[str, str]) -> float:
    max_freq = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")  # kHz
    if max_freq.exists():
        return float(max_freq.read_text()) * 1e3
    return float(info["cpu MHz"]) * 1e6 or 2.0e9


def measure_memory_bandwidth(num_threads: int) -> tuple[float, float]:
    """B/s of (a large copy, a large read-only reduction) on num_threads threads; numpy releases
    the GIL in both. A copy alone understates what weight reads (no writes) can reach."""
    src = np.random.default_rng(0).integers(0, 2**63, BANDWIDTH_BYTES // 8, dtype=np.uint64)  # (n,)
    dst = np.empty_like(src)
    bounds = np.linspace(0, len(src), num_threads + 1).astype(int)
    pieces = [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(num_threads) as pool:
        def best_s(work: Callable[[slice], object]) -> float:
            times = []
            for _ in range(BANDWIDTH_REPEATS):
                start = time.perf_counter()
                list(pool.map(work, pieces))
                times.append(time.perf_counter() - start)
            return min(times)

        copy_s = best_s(lambda s: np.copyto(dst[s], src[s]))
        read_s = best_s(lambda s: np.bitwise_or.reduce(src[s]))
    return 2 * src.nbytes / copy_s, src.nbytes / read_s
