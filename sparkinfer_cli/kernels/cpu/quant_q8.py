"""int8 activations for the decode kernels, as llama.cpp quantizes them (T = 1 decode).

x is quantized into blocks of 32 (llama.cpp's Q8_0/Q8_1 form, scales kept in float32):

    xd[t, b] = max|x[t, 32b:32b+32]| / 127     xq = rint(x / xd) as int8     xs = xd * sum(xq)

A weight block then contributes an integer dot of its quants with xq and one float multiply-add
with the scales (ggml_vec_dot_<type>_q8_0 / _q8_1); offsets (Q4_1/Q5_1's m, the K-quants' mins)
multiply xs. K-quants use these 32-blocks too rather than llama.cpp's Q8_K (one scale per 256):
one quantization of x serves every type (quant_packed.py's kernels).
"""

from __future__ import annotations

import numpy as np
from numba import njit

Q8_BLOCK = 32  # activation block: one float scale per 32 int8 values
_f32 = np.float32


@njit(cache=True, nogil=True)
def quantize_rows(x, xq, xd, xs):
    """x (T, ne0) float32 → xq (T, ne0) int8, xd and xs (T, ne0 / 32) float32."""
    for t in range(x.shape[0]):
        for b in range(x.shape[1] // Q8_BLOCK):
            e = b * Q8_BLOCK
            amax = _f32(0)
            for i in range(Q8_BLOCK):
                amax = max(amax, abs(x[t, e + i]))
            d = amax / _f32(127)
            qsum = 0
            for i in range(Q8_BLOCK):
                q = np.rint(x[t, e + i] / d) if d > 0 else _f32(0)
                xq[t, e + i] = np.int8(q)
                qsum += np.int64(q)
            xd[t, b] = d
            xs[t, b] = d * _f32(qsum)
