"""Direct CUDA driver calls for the per-step host ↔ device traffic and stream ordering.

A decode step's inputs (a few KB) and outputs (token ids) cross the bus every step; numba's
copy_to_device / copy_to_host spend tens of µs of Python per call around one cuMemcpy*Async, which
on the H200 is a visible share of a 4 ms step. These go straight to the driver with the pointers
the arrays already hold. The simulator has no driver: there they fall back to numba's copies.
"""

from __future__ import annotations

from cuda.bindings import driver

from sparkinfer_cli.kernels.cuda.runtime.intrinsics import IS_SIMULATOR


def stream_handle(s) -> int:
    """The CUstream of a numba stream, a cuda.core Stream or a graph builder (its stream)."""
    s = s if hasattr(s, "handle") else s.stream
    handle = s.handle
    return int(getattr(handle, "value", handle) or 0)


def check(result) -> object:
    """Raise on a driver error; else the call's first output (or None)."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if rest else None


def allow_dynamic_shared(kernel_handle, n_bytes: int) -> None:
    """Let launches of a kernel (a cuda.core kernel's CUkernel handle) ask for n_bytes of dynamic
    shared memory: over 48 KiB, the driver refuses a launch until the function opts in."""
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    dev = check(driver.cuCtxGetDevice())
    check(driver.cuKernelSetAttribute(attr, n_bytes, kernel_handle, dev))


def _device_ptr(arr) -> int:
    return int(arr.__cuda_array_interface__["data"][0])


def copy_to_device_async(dst, src, stream) -> None:
    """dst (device array) ← src (a pinned host array of as many bytes), queued on stream."""
    if IS_SIMULATOR:
        dst.copy_to_device(src, stream=stream)
        return
    check(driver.cuMemcpyHtoDAsync(_device_ptr(dst), src.ctypes.data, src.nbytes,
                                   stream_handle(stream)))


def copy_to_host_async(dst, src, stream) -> None:
    """dst (a pinned host array) ← src (device array of the same size in bytes), queued on stream:
    read dst after synchronizing the stream."""
    if IS_SIMULATOR:
        src.copy_to_host(dst, stream=stream)
        return
    check(driver.cuMemcpyDtoHAsync(dst.ctypes.data, _device_ptr(src), dst.nbytes,
                                   stream_handle(stream)))


def copy_device_async(dst, src, stream) -> None:
    """dst ← src (device arrays of the same size in bytes), queued on stream."""
    if IS_SIMULATOR:
        dst.copy_to_device(src, stream=stream)
        return
    check(driver.cuMemcpyDtoDAsync(_device_ptr(dst), _device_ptr(src), dst.nbytes,
                                   stream_handle(stream)))


class StreamMark:
    """A point in a stream's queue the host can wait for (a CUDA event without timing): wait()
    returns once the work queued before record() has finished. The simulator runs every launch
    at once, so there it does nothing."""

    def __init__(self):
        self._event = None if IS_SIMULATOR else check(
            driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING))

    def record(self, stream) -> None:
        if self._event is not None:
            check(driver.cuEventRecord(self._event, stream_handle(stream)))

    def wait(self) -> None:
        if self._event is not None:
            check(driver.cuEventSynchronize(self._event))

    def close(self) -> None:
        """Destroys the event (a mark of a short-lived owner; closing twice does nothing)."""
        if self._event is not None:
            check(driver.cuEventDestroy(self._event))
            self._event = None
