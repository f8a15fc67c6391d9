"""jit.kernel: chained kernels must begin with chain_start() (else they would race with the
kernel before them once launched as its programmatic dependent)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from numba import cuda, float32

from sparkinfer_cli.kernels.cuda.runtime import jit
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import chain_start

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


@pytest.mark.parametrize("n_bytes", [16 * 1024, 100 * 1024])
def test_a_kernel_gets_the_dynamic_shared_memory_it_asks_for(n_bytes):
    # over 48 KiB a launch fails unless the function opted in first (jit's launch does it)
    @jit.kernel
    def reverse_through_shared(x, out):
        chain_start()
        buf = cuda.shared.array(0, float32)
        n = x.size
        for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            buf[i] = x[i]
        cuda.syncthreads()
        for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            out[i] = buf[n - 1 - i]

    x = np.random.default_rng(0).standard_normal(n_bytes // 4).astype(np.float32)
    out = cuda.device_array_like(x)
    reverse_through_shared[1, 128, 0, n_bytes](cuda.to_device(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), x[::-1])


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
