"""Launch helpers: grid arithmetic, argument checks, raw-bytes device buffers."""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1)."""
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def multiprocessors() -> int:
    """The current device's SM count; 2 under the simulator, so that kernels whose blocks walk
    several work items (a grid of one wave) do so in the tests too."""
    return getattr(cuda.get_current_device(), "MULTIPROCESSOR_COUNT", None) or 2


def check_array(name: str, arr, dtype, shape: tuple[int, ...] | None = None) -> None:
    """Raise ValueError unless `arr` is a C-contiguous array of `dtype` (and `shape` if given)."""
    if np.dtype(arr.dtype) != np.dtype(dtype):
        raise ValueError(f"{name}: dtype {arr.dtype}, expected {np.dtype(dtype)}")
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(arr.shape)}, expected {tuple(shape)}")
    if not arr.flags["C_CONTIGUOUS"] if isinstance(arr, np.ndarray) else not arr.is_c_contiguous():
        raise ValueError(f"{name}: must be C-contiguous")


def to_device_bytes(raw: np.ndarray, stream=0):
    """Upload raw bytes as a flat uint8 device array with 16 to 31 zero bytes of tail padding.

    The padding lets GEMV kernels read aligned words that straddle the end of the last row.
    """
    flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    dev = cuda.device_array(cdiv(flat.size + 16, 16) * 16, np.uint8, stream=stream)  # (n + pad,)
    dev[flat.size:].copy_to_device(np.zeros(dev.size - flat.size, np.uint8), stream=stream)
    dev[: flat.size].copy_to_device(flat, stream=stream)
    return dev
