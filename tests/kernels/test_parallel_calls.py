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
    with pytest.raises(ValueError, match="parts end at record 2 of 1"):
        parallel_calls.run_parts(calls, np.array([2], np.int64))
    assert not buf.any()

