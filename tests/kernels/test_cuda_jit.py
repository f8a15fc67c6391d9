"""jit.kernel: chained kernels must begin with chain_start() (else they would race with the
kernel before them once launched as its programmatic dependent)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import jit
from sparkinfer_cli.kernels.cuda.intrinsics import chain_start
from sparkinfer_cli.kernels.cuda.jit import chain_start_prefetching

KERNELS = Path(jit.__file__).parent


def test_a_chained_kernel_waits_before_its_first_statement_and_runs():
    @jit.kernel
    def double(x, out):
        """A docstring may come first."""
        chain_start()
        i = cuda.grid(1)
        if i < x.size:
            out[i] = 2 * x[i]

    x = np.arange(40, dtype=np.float32)
    out = cuda.device_array_like(x)
    double[2, 32](cuda.to_device(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), 2 * x)


def test_a_kernel_may_begin_by_prefetching_and_a_prefetch_past_the_array_fails():
    @jit.kernel
    def prefetch_then_copy(w, n_bytes, out):
        chain_start_prefetching(w, w, cuda.blockIdx.x * 64, n_bytes)
        i = cuda.grid(1)
        if i < w.size:
            out[i] = w[i]

    w = np.arange(256, dtype=np.uint8)
    out = cuda.device_array_like(w)
    prefetch_then_copy[4, 64](cuda.to_device(w), 64, out)  # block b: bytes [64b, 64b + 64)
    np.testing.assert_array_equal(out.copy_to_host(), w)
    with pytest.raises(IndexError, match="prefetch of byte 256"):
        prefetch_then_copy[4, 64](cuda.to_device(w), 129, out)  # block 2: [128, 257) runs past w


def test_a_kernel_that_touches_anything_before_chain_start_is_refused():
    def reads_first(x, out):
        i = cuda.grid(1)
        chain_start()
        out[i] = x[i]

    def no_wait(x, out):
        out[0] = x[0]

    for body in (reads_first, no_wait):
        with pytest.raises(TypeError, match="must begin with chain_start"):
            jit.kernel(fastmath=True)(body)


def test_every_kernel_of_the_package_is_chained():
    # a plain cuda.jit kernel is correct but puts a launch gap back into the decode chain
    # (device functions are not launched)
    for path in sorted(KERNELS.glob("*.py")):
        for line in path.read_text().splitlines():
            if re.match(r"\s*@cuda\.jit\b", line):
                assert "device=True" in line or "**options" in line, f"{path.name}: {line}"
