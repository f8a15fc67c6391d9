"""parallel_calls: records of native calls run in parts, each part's records in order."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from sparkinfer_cli.kernels.cpu import parallel_calls
from sparkinfer_cli.kernels.cpu.parallel_calls import CALL_FIELDS

_LIBC = ctypes.CDLL(None)
_MEMSET = parallel_calls.address(_LIBC.memset)  # memset(ptr, byte, n): 3 of the 11 arguments


def _fill(buf: np.ndarray, at: int, byte: int, n: int) -> tuple[int, ...]:
    return (_MEMSET, buf.ctypes.data + at, byte, n) + (0,) * (CALL_FIELDS - 4)


def test_every_record_of_every_part_runs_in_order() -> None:
    """Three parts of 2, 0 and 3 records; within a part a later record overwrites an earlier
    one's bytes, so the order shows."""
    buf = np.zeros(64, np.uint8)
    calls = np.array([_fill(buf, 0, 1, 16), _fill(buf, 8, 2, 8),  # part 0: bytes 0-7 1, 8-15 2
                      _fill(buf, 16, 3, 16), _fill(buf, 24, 4, 8), _fill(buf, 40, 5, 4)],
                     np.int64)
    parallel_calls.run_parts(calls, np.array([2, 2, 5], np.int64))
    want = np.zeros(64, np.uint8)
    want[0:8], want[8:16], want[16:24], want[24:32], want[40:44] = 1, 2, 3, 4, 5
    np.testing.assert_array_equal(buf, want)


def test_bad_records_are_refused_before_anything_runs() -> None:
    buf = np.zeros(8, np.uint8)
    calls = np.array([_fill(buf, 0, 1, 8)], np.int64)
    with pytest.raises(ValueError, match="C-contiguous int64"):
        parallel_calls.run_parts(calls[:, :4], np.array([1], np.int64))
    with pytest.raises(ValueError, match=r"part ends \[2\] do not split 1 records"):
        parallel_calls.run_parts(calls, np.array([2], np.int64))
    assert not buf.any()



def test_jobs_from_several_threads_each_run_once_whole() -> None:
    """Four threads post 300 jobs each (two parts: the caller's and a helper's), some after the
    helpers have gone to sleep; every job's bytes are written, none is skipped or runs twice
    (a helper that missed a job would leave its caller waiting: the threads would not finish)."""
    import threading
    import time

    bufs = [np.zeros(32, np.uint8) for _ in range(4)]
    errors: list[str] = []

    def post(t: int) -> None:
        buf = bufs[t]
        for i in range(300):
            byte = 1 + (i % 250)
            calls = np.array([_fill(buf, 0, byte, 16), _fill(buf, 16, byte, 16)], np.int64)
            parallel_calls.run_parts(calls, np.array([1, 2], np.int64))
            if not (buf == byte).all():
                errors.append(f"thread {t} job {i}: {buf.tolist()}")
            if i % 100 == 99:
                time.sleep(0.02)  # the helpers go from spinning to polling

    threads = [threading.Thread(target=post, args=(t,), daemon=True) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a job never finished"
    assert not errors, errors[:3]
