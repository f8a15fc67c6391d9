"""How device functions are compiled: inlined into their callers by NVVM.

numba's own inlining (`inline=True`, at the level of its IR) retypes the callee at every call
site: the decode-attention kernel took ~120 s to compile that way and ~10 s with NVVM's
alwaysinline (`forceinline`), to the same instruction mix and no spills; all 50 kernels the kernel
tests launch: 386 → 76 s (bench/cuda_compile_check.py compiles every kernel the simulator tests
launch, for sm_90, without a GPU). The simulator's jit takes no forceinline: it runs the Python
functions as they are.

Fast math: numba's IR inlining lowered a callee under its caller's flags; through NVVM a device
function keeps its own. Most callers are fastmath kernels, and a precise callee there cost 13 % of
the RMSNorm kernel's time (div.full for the q8 scale division, libdevice expf) and 4 % of decode
attention's (H200, Qwen3.6 shape, 32k context): device functions are fastmath unless they say
otherwise. Those that must order ±inf exactly (fastmath assumes no infinities) pass
fastmath=False.
"""

from __future__ import annotations

from numba import cuda

from sparkinfer_cli.kernels.cuda.intrinsics import IS_SIMULATOR


def device_function(fn=None, *, fastmath: bool = True, numba_inline: bool = False):
    """@device_function or @device_function(fastmath=True, ...): a cuda.jit device function.

    numba_inline: inline at numba's IR level instead, for device functions that take a caller's
    local array that must stay in registers (the tensor-core GEMM's accumulators: through NVVM
    inlining its array stayed in local memory, 128-256 stack bytes a thread)."""
    options = {"device": True, "fastmath": fastmath}
    if numba_inline:
        options["inline"] = "always"
    elif not IS_SIMULATOR:
        options["forceinline"] = True
    jit = cuda.jit(**options)
    return jit if fn is None else jit(fn)
