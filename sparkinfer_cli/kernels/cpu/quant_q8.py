"""int8 activations for the decode kernels, as llama.cpp quantizes them (T = 1 decode).

x is quantized into blocks of 32 (llama.cpp's Q8_0/Q8_1 form, scales kept in float32):

    xd[t, b] = max|x[t, 32b:32b+32]| / 127     xq = rint(x / xd) as int8     xs = xd * sum(xq)

A weight block then contributes an integer dot of its quants with xq and one float multiply-add
with the scales (ggml_vec_dot_<type>_q8_0 / _q8_1); offsets (Q4_1/Q5_1's m, the K-quants' mins)
multiply xs. K-quants use these 32-blocks too rather than llama.cpp's Q8_K (one scale per 256):
one quantization of x serves every type (quant_packed.py's kernels; quantize_kernel there
quantizes x in the order its row kernel reads).
"""

from __future__ import annotations

Q8_BLOCK = 32  # activation block: one float scale per 32 int8 values
