"""Random but valid quantized weights shared by the int8-activation kernel tests."""

from __future__ import annotations

import numpy as np

from sparkinfer_cli.gguf.ggml_types import BLOCK_GEOMETRY, GGMLType, row_bytes

# byte offsets of each block's fp16 scale fields (d, and dmin / m where present)
FP16_FIELDS = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
}
NE0 = 768  # three 256-superblocks, 24 activation blocks
N_ROWS = 37


def random_weight(t: GGMLType, rng: np.random.Generator, ne0: int = NE0) -> np.ndarray:
    """(N_ROWS, row_bytes) of random quant bytes with finite fp16 scales of either sign."""
    block, size = BLOCK_GEOMETRY[t]
    n_blocks = N_ROWS * ne0 // block
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)  # (n_blocks, block_bytes)
    for off in FP16_FIELDS[t]:
        scale = rng.uniform(1e-3, 0.1, n_blocks) * rng.choice([-1, 1], n_blocks)
        raw[:, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(N_ROWS, row_bytes(t, ne0))
