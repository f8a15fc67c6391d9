"""Run numpy's OpenBLAS single-threaded for a while.

This is what threadpoolctl does, without the dependency.

The tiled quant matmul runs its own threads, one tile each (dequantize, then GEMM). OpenBLAS's
threads would compete with them, and after each call they spin-wait: measured on 2 cores, a
(1170 x 896) @ (896 x 8) GEMM took 7 ms multi-threaded between dequant calls, 0.45 ms
single-threaded. If numpy's BLAS is not an OpenBLAS we can find, this does nothing.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import numpy as np  # noqa: F401  (loads numpy's BLAS, which we look for below)


@cache
def _openblas_thread_api() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for path in sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", maps.read_text()))):
        lib = ctypes.CDLL(path)
        for prefix in ("scipy_openblas_", "openblas_"):
            for suffix in ("64_", ""):
                get, set_ = (getattr(lib, f"{prefix}{op}_num_threads{suffix}", None)
                             for op in ("get", "set"))
                if get is not None and set_ is not None:
                    get.restype = ctypes.c_int
                    set_.argtypes = [ctypes.c_int]
                    return get, set_
    return None


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    api = _openblas_thread_api()
    if api is None:
        yield
        return
    get, set_ = api
    before = get()
    set_(1)
    try:
        yield
    finally:
        set_(before)
