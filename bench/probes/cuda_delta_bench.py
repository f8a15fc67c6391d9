"""GPU time of the Gated DeltaNet recurrent kernels at the Qwen3.6-35B-A3B shape (one layer).

    python bench/probes/cuda_delta_bench.py [--tokens 4096] [--split 1,16] [--batch 64] [--reps 20]

Cases, as CudaGatedDeltaNet launches them (seq_lo / seq_n / state_slots hold n_rows entries, the
unused ones zero): a prefill of --tokens rows in K sequences for each K of --split (as a burst
of clients sends them), run as the model runs multi-token passes (prepare: q/k norms and gates
computed for all rows first), without that step, and a chunk of tokens at a time on tensor cores
(gated_delta_chunked, SPARKINFER_GDN_CHUNKED; and each of its two kernels alone), and a decode
step of --batch sequences of one token each. Per case: µs per launch (CUDA events, mean of
--reps), µs per token, the 30-layer total, and effective GB/s over the bytes the kernel must
move (state read + written, q/k/v/gates read, output written).
"""
from __future__ import annotations

import argparse

import numpy as np
from numba import cuda

from sparkinfer_cli.kernels.cuda import gated_delta as gd
from sparkinfer_cli.kernels.cuda import gated_delta_chunked as gdc

H_K, H_V, DK, DV, K_CONV, GDN_LAYERS = 16, 32, 128, 128, 4, 30
CONV_DIM = 2 * H_K * DK + H_V * DV


def _case(rng, lengths: list[int], n_rows: int) -> dict:
    """Device inputs of one launch: sequence s owns lengths[s] consecutive rows and slot s."""
    n_seqs = len(lengths)
    ints = np.zeros((3, n_rows), np.int32)  # state_slots, seq_lo, seq_n
    ints[0, :n_seqs] = np.arange(n_seqs)
    ints[0, n_seqs:] = n_seqs  # the scratch slot, as the workspace fills it
    ints[1, :n_seqs] = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ints[2, :n_seqs] = lengths
    f32 = np.float32
    host = {"u": rng.standard_normal((n_rows, CONV_DIM)).astype(f32) * f32(0.5),
            "a": rng.standard_normal((n_rows, H_V)).astype(f32),
            "b": rng.standard_normal((n_rows, H_V)).astype(f32),
            "ssm_a": -rng.uniform(0.5, 2, H_V).astype(f32),
            "dt_bias": rng.standard_normal(H_V).astype(f32),
            "state": (rng.standard_normal((n_seqs + 1, H_V, DV, DK)) * 0.1).astype(f32),
            "conv_w": rng.standard_normal((CONV_DIM, K_CONV)).astype(f32),
            "conv_state": rng.standard_normal((n_seqs + 1, CONV_DIM, K_CONV - 1)).astype(f32),
            "state_slots": ints[0], "seq_lo": ints[1], "seq_n": ints[2]}
    dev = {k: cuda.to_device(np.ascontiguousarray(v)) for k, v in host.items()}
    dev["out"] = cuda.device_array((n_rows, H_V, DV), f32)
    dev["conv_out"] = cuda.device_array((n_rows, CONV_DIM), f32)
    lists = np.empty((2, n_rows), np.int32)
    gdc.chunk_list(ints[1, :n_seqs], ints[2, :n_seqs], lists[0], lists[1])
    scratch = cuda.device_array((n_rows, H_V, gdc.scratch_cols(DK, DV)), f32)
    dev["chunks"] = gdc.ChunkedPass(scratch, *(cuda.to_device(x) for x in lists))
    return dev


def _delta(d: dict, prepare: bool = False, chunked: bool = False) -> None:
    """One launch; prepare rewrites u's q/k and a/b in place, which stay finite and non-zero
    when prepared again (k keeps unit norm, q returns to 1/sqrt(dk), gates map into (0, 1))."""
    gd.delta_rule_seq(d["u"], d["a"], d["b"], d["ssm_a"], d["dt_bias"], d["state"],
                      d["state_slots"], d["seq_lo"], d["seq_n"], d["out"], n_k_heads=H_K,
                      head_map_mod=True, eps=1e-6, prepare=prepare,
                      chunks=d["chunks"] if chunked else None)


def _prepared(d: dict) -> None:
    _delta(d, prepare=True)


def _chunked(d: dict) -> None:
    _delta(d, prepare=True, chunked=True)


def _chunk_prep(d: dict) -> None:
    """chunk_prep alone, on the inputs _chunked last prepared."""
    gdc.launch_prep(d["u"], d["a"], d["b"], d["chunks"], n_k_heads=H_K,
                    head_map_mod=True, dk=DK, chunk=gdc.CHUNK)


def _chunk_recur(d: dict) -> None:
    """chunk_recur alone, over the scratch chunk_prep wrote."""
    gdc.launch_recur(d["u"], d["chunks"], d["state"], d["state_slots"], d["seq_lo"],
                     d["seq_n"], d["out"], n_k_heads=H_K, head_map_mod=True, chunk=gdc.CHUNK,
                     cols=gdc.COLS)


def _conv(d: dict) -> None:
    gd.conv_silu_seq(d["u"], d["conv_w"], d["conv_state"], d["state_slots"], d["seq_lo"],
                     d["seq_n"], d["conv_out"])


@cuda.jit
def _spin(n_ms):
    for _ in range(n_ms):
        cuda.nanosleep(1000000)


def _gpu_us(fn, d: dict, reps: int) -> float:
    """Mean GPU µs of fn(d) over reps back-to-back launches.

    A sleeping kernel holds the GPU while the host enqueues the events and launches, so the
    events time the kernels and not the host's launch overhead (tens of µs a launch here)."""
    fn(d)  # compile + warm up
    cuda.synchronize()
    start, stop = cuda.event(), cuda.event()
    _spin[1, 1](2 + reps // 2)
    start.record()
    for _ in range(reps):
        fn(d)
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / reps


def _report(name: str, us: float, tokens: int, n_seqs: int, bytes_per_token: int) -> None:
    state_bytes = 2 * n_seqs * H_V * DV * DK * 4  # read + written once per launch
    gbs = (state_bytes + tokens * bytes_per_token) / us / 1e3
    print(f"{name:<34} {us:10.1f} µs  {us / tokens:8.3f} µs/token  "
          f"x{GDN_LAYERS} layers {us * GDN_LAYERS / 1e3:8.2f} ms  {gbs:8.0f} GB/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--split", default="1", help="comma-separated prefill sequence counts")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"device: {getattr(cuda.get_current_device(), 'name', '?')}; H_k {H_K}, H_v {H_V}, "
          f"dk {DK}, dv {DV}")
    delta_bytes = 4 * (2 * H_K * DK + H_V * DV + 2 * H_V + H_V * DV)  # q,k,v,a,b in; out
    conv_bytes = 4 * 2 * CONV_DIM  # mixed in, out
    cases = [(f"prefill {k} × {args.tokens // k}", [args.tokens // k] * k, args.tokens, True)
             for k in map(int, args.split.split(","))]
    cases.append((f"decode {args.batch} × 1", [1] * args.batch, args.batch, False))
    for name, lengths, n_rows, multi_token in cases:
        d = _case(rng, lengths, n_rows)
        _report(f"delta_rule_seq {name}", _gpu_us(_delta, d, args.reps), sum(lengths),
                len(lengths), delta_bytes)
        if multi_token:
            _report(f"  prepared {name}", _gpu_us(_prepared, d, args.reps), sum(lengths),
                    len(lengths), delta_bytes)
            _report(f"  chunked {name}", _gpu_us(_chunked, d, args.reps), sum(lengths),
                    len(lengths), delta_bytes)
            for part, fn in (("prep", _chunk_prep), ("recur", _chunk_recur)):
                _report(f"    chunk_{part} {name}", _gpu_us(fn, d, args.reps), sum(lengths),
                        len(lengths), delta_bytes)
        if not np.isfinite(d["out"].copy_to_host()).all():
            raise SystemExit("delta_rule_seq wrote non-finite outputs")
        _report(f"conv_silu_seq  {name}", _gpu_us(_conv, d, args.reps), sum(lengths), 0,
                conv_bytes)


if __name__ == "__main__":
    main()
