"""How kernels and device functions are compiled: device functions inlined into their callers by
NVVM, kernels launched as programmatic dependents of the kernel before them.

numba's own inlining (`inline=True`, at the level of its IR) retypes the callee at every call
site, which made the large kernels compile several times slower than NVVM's alwaysinline
(`forceinline`) does, to the same instruction mix and no spills (figures in
bench/results/2026-11-30-cuda-decode-latency.md; bench/probes/cuda_compile_check.py compiles
every kernel the simulator tests launch, for sm_90, without a GPU). The simulator's jit takes no
forceinline: it runs the Python functions as they are.

Fast math: numba's IR inlining lowered a callee under its caller's flags; through NVVM a device
function keeps its own. Most callers are fastmath kernels, where a precise callee is slow
(div.full for the q8 scale division in RMSNorm, libdevice expf in decode attention): device
functions are fastmath unless they say otherwise. Those that must order ±inf exactly (fastmath
assumes no infinities) pass fastmath=False.
"""

from __future__ import annotations

import dis

from numba import cuda

from sparkinfer_cli import env
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import IS_SIMULATOR

_CHAINED = "_sparkinfer_chained"  # set on the Python function of every jit.kernel


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


def kernel(fn=None, **options):
    """@kernel or @kernel(fastmath=True, ...): a cuda.jit kernel launched as a programmatic
    dependent (PDL, sm_90) of the kernel before it on its stream, eagerly and in CUDA graphs.

    A decode step is hundreds of launches of a few µs each; between two plain launches the GPU
    idles while the next grid starts. A chained kernel is launched while its predecessor still
    runs, its blocks wait on the SMs, and go the moment the predecessor's writes are visible
    (what that gains a decode step: bench/results/2026-11-30-cuda-decode-latency.md). For
    that the body must begin with `chain_start()` (intrinsics), checked here: a chained kernel
    that touched memory before it would race with its predecessor. SPARKINFER_CUDA_PDL=0
    launches every kernel plainly."""
    def wrap(f):
        if not _begins_with_chain_start(f):
            raise TypeError(f"kernel {f.__qualname__}: the body must begin with chain_start()")
        setattr(f, _CHAINED, True)
        if IS_SIMULATOR:  # its jit has no register budget
            options.pop("max_registers", None)
        return cuda.jit(**options)(f)
    return wrap if fn is None else wrap(fn)


def _begins_with_chain_start(f) -> bool:
    """Whether f's bytecode begins with a call of the global chain_start without arguments (the
    bytecode, not the source: that may have changed on disk since the module was imported)."""
    ops = [i for i in dis.get_instructions(f) if i.opname not in _PROLOGUE_OPS]
    return (len(ops) >= 2 and ops[0].opname == "LOAD_GLOBAL" and ops[0].argval == "chain_start"
            and ops[1].opname in ("CALL", "CALL_FUNCTION") and ops[1].arg == 0)


_PROLOGUE_OPS = frozenset({"RESUME", "NOP", "PUSH_NULL", "PRECALL", "COPY_FREE_VARS", "MAKE_CELL",
                           "EXTENDED_ARG", "CACHE"})


STATIC_SHARED_LIMIT = 48 * 1024  # bytes of shared memory a launch gets without opting in


def _install_launch() -> None:
    """numba-cuda launches through cuda.core (`launch(stream, LaunchConfig, kernel, *args)` in
    _Kernel.launch). Two additions: a launch asking for more than STATIC_SHARED_LIMIT bytes of
    dynamic shared memory first raises the function's limit (the driver refuses the launch
    otherwise, and numba never sets it); chained kernels (PDL on, sm_90) get the same launch with
    programmatic stream serialization.
    NOTE: wraps a private method of numba-cuda 0.30; other versions keep plain launches."""
    from importlib.metadata import version

    from numba.cuda import dispatcher

    from sparkinfer_cli.kernels.cuda.runtime import driver_calls

    plain = dispatcher._Kernel.launch
    if not version("numba-cuda").startswith("0.30."):
        return
    chain = env.SPARKINFER_CUDA_PDL.get() and cuda.get_current_device().compute_capability >= (9, 0)
    raised: dict[int, int] = {}  # id of a cufunc → dynamic shared bytes its limit allows

    def launch(self, args, griddim, blockdim, stream=0, sharedmem=0):
        cufunc = self._codelibrary.get_cufunc()
        if sharedmem > max(STATIC_SHARED_LIMIT, raised.get(id(cufunc), 0)):
            driver_calls.allow_dynamic_shared(cufunc.handle, sharedmem)
            raised[id(cufunc)] = sharedmem
        if not (chain and getattr(self.py_func, _CHAINED, False)) or self.debug \
                or self.cooperative:
            return plain(self, args, griddim, blockdim, stream, sharedmem)
        retr, kernelargs = [], []  # as _Kernel.launch marshals them
        for t, v in zip(self.argument_types, args):
            self._prepare_args(t, v, stream, retr, kernelargs)
        config = dispatcher.LaunchConfig(grid=griddim, block=blockdim, shmem_size=sharedmem,
                                         programmatic_stream_serialization=True)
        dispatcher.launch(stream, config, cufunc.kernel, *kernelargs)
        for write_back in retr:
            write_back()

    dispatcher._Kernel.launch = launch


if not IS_SIMULATOR and cuda.is_available():
    _install_launch()
