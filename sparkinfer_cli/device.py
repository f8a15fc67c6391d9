"""Which backend to run on: CUDA when a GPU is present (and asked for or left to auto), else CPU."""

from __future__ import annotations

import functools

DEVICES = ("auto", "cpu", "cuda")


@functools.cache
def has_gpu() -> bool:
    try:
        from numba import cuda
        return bool(cuda.is_available())
    except Exception:  # numba-cuda missing or no driver: no GPU for us
        return False


def pick_device(requested: str) -> str:
    if requested not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, not {requested!r}")
    if requested == "auto":
        return "cuda" if has_gpu() else "cpu"
    if requested == "cuda" and not has_gpu():
        raise ValueError("--device cuda was asked for, but no CUDA GPU is available")
    return requested
