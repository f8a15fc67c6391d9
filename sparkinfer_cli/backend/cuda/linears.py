"""Linear layers on the device: which kernel multiplies a pass's tokens by a weight.

A linear decides from the pass's token count and its matrix type: the quantized GEMV (a few
tokens: decode), or a tensor-core GEMM (mma_gemm on f16 tiles; mmq_q8 on int8 activations for
Q8_0 at any token count; gemm_f16 over an f16 copy of the weights, where the linear keeps one, for
long passes), splitting k over the grid when the row blocks alone do not fill the GPU.
Exact mode (float32 weights, the oracle tests) always takes the GEMV. The workspace only holds
the buffers they read and write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkinfer_cli.kernels.cuda import gemm_f16, mma_gemm, mmq_q8
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.runtime.graphs import side_stream

if TYPE_CHECKING:
    from sparkinfer_cli.backend.cuda.workspace import Act, Workspace

# Passes of at least this many tokens run the MoE experts as grouped tensor-core GEMMs (tokens
# sorted by expert). A GEMM block walks all of k, a few µs a step: a decode batch gives an expert
# ~2 tokens, and the per-slot GEMVs finish first.
EXPERTS_MMA_MIN_ROWS = 256
# Dense linears of at least this many tokens run as tensor-core GEMMs: each weight is dequantized
# once per token tile, where the GEMV re-reads and re-dequantizes its matrix once per 8 tokens
# (what that cost at 64 sequences: bench/results/2026-11-30-cuda-decode-latency.md).
LINEAR_MMA_MIN_ROWS = 32
# Dense linears with an f16 copy of their weights (gemm_f16) take it from this many tokens: a
# compute-bound pass, where the quantized GEMMs' staging and scaling cost more than the copy's
# twice as many weight bytes.
F16_GEMM_MIN_ROWS = 1024


def sums_in_fixed_order(ws: Workspace) -> bool:
    """Whether this pass's GEMVs sum each output in the order its matrix alone fixes, so that a
    row's numbers do not depend on the rows beside it: where the pass's dense linears are GEMVs
    too. From LINEAR_MMA_MIN_ROWS rows they run as tensor-core GEMMs, whose sums differ from the
    GEMV's anyway, and the GEMVs keep the launch shape's faster order (what the fixed one costs
    at 64 sequences: bench/results/2026-12-04-qwen3-30b-a3b-cuda-gemv-fixed-order.md)."""
    return not ws.quantized or ws.rows_as_decodes


@dataclass
class DeviceLinear:
    """y = W·x (+ bias) on the device; `matrix` holds n_mats stacked matrices (experts)."""
    matrix: qg.DeviceQuantMatrix
    bias: object | None = None  # float32 device (n_rows,)
    half: gemm_f16.HalfMatrix | None = None  # the weights as f16, for long passes

    @property
    def n_rows(self) -> int:
        return self.matrix.n_rows

    @property
    def takes_float_activations(self) -> bool:
        return self.matrix.takes_float_activations

    def on_tensor_cores(self, ws: Workspace, n_tokens: int, experts: bool = False) -> bool:
        """Whether n_tokens rows of ws's pass (experts: the MoE experts' slots) run as a
        tensor-core GEMM rather than the GEMV."""
        min_rows = EXPERTS_MMA_MIN_ROWS if experts else LINEAR_MMA_MIN_ROWS
        return ws.quantized and n_tokens >= min_rows and mma_gemm.supports(self.matrix)

    def reads_q8(self, ws: Workspace, n_tokens: int) -> bool:
        """Whether the product over n_tokens rows reads the q8 activations (x.q), which the caller
        must then have quantized: the GEMVs of quantized types and the int8 tensor-core GEMM."""
        if not ws.quantized or self.takes_float_activations or self._on_f16_gemm(n_tokens):
            return False
        return not self.on_tensor_cores(ws, n_tokens) or self._on_int8_gemm(n_tokens)

    def _on_f16_gemm(self, n_tokens: int, fused: bool = False) -> bool:
        """Long passes over a linear with an f16 copy take gemm_f16 (no fused SwiGLU there)."""
        return self.half is not None and not fused and n_tokens >= F16_GEMM_MIN_ROWS

    def _on_int8_gemm(self, n_tokens: int) -> bool:
        """Q8_0 products take the int8 GEMM over the q8 activations (mmq_q8) at every token count:
        it reads half the bytes of the f16 tiles and its mma does twice the work a step."""
        return mmq_q8.supports(self.matrix, n_tokens)

    def __call__(self, ws: Workspace, x: Act, y, stream, up: DeviceLinear | None = None) -> None:
        """y (groups, cols, rows) = W·x (+ bias); up: fused silu(W·x) ⊙ (up·x).

        y may be a list of arrays (groups, cols, rows_i) when the matrix stacks several linears."""
        groups = (y[0] if isinstance(y, list) else y).shape[0]
        n_tokens = x.f.shape[0] * x.f.shape[1]
        up_matrix = None if up is None else up.matrix
        if not self.on_tensor_cores(ws, n_tokens):
            qg.gemv(self.matrix, x.for_matrix(self.matrix), y, slot_mat=ws.zeros_i32(groups),
                    slot_x=ws.iota(groups), up=up_matrix, bias=self.bias, stream=stream,
                    fixed_order=sums_in_fixed_order(ws))
            return
        parts = [p.reshape(n_tokens, -1) for p in (y if isinstance(y, list) else [y])]
        half = self.half if self._on_f16_gemm(n_tokens, up is not None) else None
        if half is not None:
            gemm_f16.matmul(half, ws.half_activations(x.f, stream), parts, bias=self.bias,
                            stream=stream)
            return
        gemm, xs = ((mmq_q8, x.q) if self._on_int8_gemm(n_tokens)
                    else (mma_gemm, x.f.reshape(n_tokens, -1)))
        partials = ws.gemm_partials(gemm.partials_size(self.matrix, n_tokens, up is not None),
                                    stream)
        gemm.matmul(self.matrix, xs, parts, bias=self.bias, up=up_matrix, stream=stream,
                    partials=partials)


@dataclass
class StackedLinears:
    """Linears that read the same input, as few stacked matrices (one GEMV each).

    stacks: (matrix holding the members' rows back to back, the members' indices in order);
    n_rows: each member's output size, in the order the members were given."""
    stacks: list[tuple[DeviceLinear, tuple[int, ...]]]
    n_rows: tuple[int, ...]

    def __call__(self, ws: Workspace, x: Act, names: tuple[str, ...], stream,
                 beside: bool = True) -> list:
        """Each member applied to x, into ws buffers named `names`: one product a stack.

        beside: the stacks after the first (members of other weight types) run on the side
        stream, beside the first (each GEMV is latency-bound and leaves most of the GPU idle);
        False where the side stream is busy with other work the caller must not wait for."""
        outs = [ws.buf(name, ws.groups, ws.cols, n) for name, n in zip(names, self.n_rows)]
        (first, first_members), *rest = self.stacks
        side = side_stream() if beside and rest else None
        rest_stream = side.fork(stream) if side is not None else stream
        for lin, members in rest:
            lin(ws, x, [outs[i] for i in members], rest_stream)
        first(ws, x, [outs[i] for i in first_members], stream)
        if side is not None:
            side.join(stream)
        return outs
