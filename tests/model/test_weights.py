"""QTensor: slicing a GGUF tensor's encoded rows without decoding them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.gguf.synthetic import PRESETS, write_synthetic
from sparkinfer_cli.model.weights import QTensor, Weights


@pytest.fixture(scope="module")
def matrices(tmp_path_factory) -> list[QTensor]:
    """The 2-D tensors of a file whose matrices take every compute type in turn."""
    spec = replace(PRESETS["tiny-qwen3"], recipe="all-types", n_embd=512)  # two K-quant blocks
    gguf = GGUFFile(write_synthetic(tmp_path_factory.mktemp("w") / "m.gguf", spec))
    weights = Weights(gguf, spec.n_layer)
    return [weights.get(name) for name, info in gguf.tensors.items()
            if len(info.shape) == 2 and info.shape[0] == 512]


def test_column_halves_decode_to_the_matrix_columns(matrices: list[QTensor]) -> None:
    """For every type: the two halves' decoded rows are the whole matrix's columns."""
    types = {GGMLType(t.ggml_type) for t in matrices}
    assert {GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.F16} <= types  # K, legacy and float kinds
    for t in matrices:
        half = t.ne0 // 2
        whole = _decoded(t)
        for lo, hi in ((0, half), (half, t.ne0)):
            part = t.select_columns(lo, hi, t.name + ".part")
            assert part.shape == (hi - lo, t.shape[1])
            np.testing.assert_array_equal(_decoded(part), whole[:, lo:hi])


def test_columns_off_the_blocks_are_refused(matrices: list[QTensor]) -> None:
    t = next(t for t in matrices if t.ggml_type == GGMLType.Q4_K)
    with pytest.raises(ValueError, match="do not fall on its blocks"):
        t.select_columns(0, 100, "x")


def _decoded(t: QTensor) -> np.ndarray:
    from sparkinfer_cli.kernels.cpu.quant import dequantize

    if t.ggml_type in (GGMLType.F32, GGMLType.F16):
        return np.asarray(t.raw, np.float32)
    return dequantize(np.ascontiguousarray(t.raw), t.ggml_type, t.ne0)

