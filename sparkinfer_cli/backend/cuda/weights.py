"""A model's tensor records (model/tensors.py) uploaded to the GPU in their GGUF byte layout, with
a progress bar.

The records already resolve every naming variant (fused gate_up, legacy ssm_in / ssm_ba,
interleaved attn_q, tied output). `exact=True` uploads quantized matrices dequantized to F32
instead, so the GEMVs take float32 activations (no q8 activation rounding): the CPU model's math,
for the oracle tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import cuda
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from sparkinfer_cli.backend.cuda.linears import DeviceLinear, StackedLinears
from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cpu.quant import dequantize
from sparkinfer_cli.kernels.cuda import gemm_f16
from sparkinfer_cli.kernels.cuda.quant_gemv import MAX_PARTS, DeviceQuantMatrix
from sparkinfer_cli.kernels.cuda.runtime.file_upload import FileUploader
from sparkinfer_cli.kernels.cuda.runtime.launch import to_device_bytes
from sparkinfer_cli.model.weights import QTensor

# Dense linears of fewer rows keep no f16 copy: a long pass over them is short anyway.
F16_COPY_MIN_ROWS = 1024


@dataclass
class Uploader:
    """Uploads tensors, counting bytes; `progress` advances by each tensor's host size.

    f16_copies: linears asked for one (`prefill=True`) also get their weights as f16 on the
    device (gemm_f16, long passes), counted in half_bytes.
    file: reads the tensors that are whole file tensors (QTensor.offset) straight from the file
    through pinned staging, so the load never maps the weights into the process (its RSS stays
    small whatever the file's size) and reading overlaps the copies; the rest (rows cut from a
    fused tensor, exact mode's F32 rows) go from host arrays."""
    exact: bool
    progress: Progress | None = None
    task: TaskID | None = None
    n_bytes: int = 0
    n_tensors: int = 0
    stream: object = field(default_factory=lambda: cuda.default_stream())
    f16_copies: bool = False
    half_bytes: int = 0
    file: FileUploader | None = None

    def _advance(self, n_bytes: int) -> None:
        self.n_bytes += n_bytes
        self.n_tensors += 1
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, advance=n_bytes)

    def _upload_type(self, t: QTensor) -> GGMLType:
        """The type the device holds t in: its own, or F32 in exact mode."""
        return GGMLType.F32 if self.exact else GGMLType(t.ggml_type)

    def _device_bytes(self, tensors: list[QTensor]):
        """The tensors' bytes in their upload type, concatenated in one flat device array
        (launch.to_device_bytes' layout)."""
        spans = [(t.offset, t.raw.nbytes) for t in tensors if t.offset is not None]
        if self.file is not None and not self.exact and len(spans) == len(tensors):
            data = self.file.upload_ranges(spans)
        else:
            data = to_device_bytes(np.concatenate([_host_bytes(t, self.exact) for t in tensors]),
                                   self.stream)
        self._advance(data.size)
        return data

    def matrix(self, t: QTensor) -> DeviceQuantMatrix:
        """A 2-D (out, in) or 3-D (n_experts, out, in) GGUF tensor as a DeviceQuantMatrix."""
        k, n_rows = t.shape[0], t.shape[1]
        n_mats = t.shape[2] if len(t.shape) == 3 else 1
        return DeviceQuantMatrix(self._device_bytes([t]), self._upload_type(t), k, n_rows, n_mats)

    def stacked(self, members: list[tuple[QTensor, QTensor | None]],
                prefill: bool = False) -> StackedLinears:
        """Linears (weight, bias or None) that read the same input, stacked row-wise per (type, k)
        into at most MAX_PARTS members, so one GEMV computes each stack. prefill: each stack may
        keep an f16 copy (see with_half)."""
        tensors = [weight for weight, _ in members]
        biases = [None if bias is None else bias.as_f32() for _, bias in members]
        stacks = [(self.with_half(self._stack([tensors[i] for i in idx],
                                               [biases[i] for i in idx]), prefill), tuple(idx))
                  for idx in self._stackable_groups(tensors)]
        return StackedLinears(stacks, tuple(t.shape[1] for t in tensors))

    def _stackable_groups(self, tensors: list[QTensor]) -> list[list[int]]:
        """Member indices grouped by (upload type, k) in first-seen order, ≤ MAX_PARTS each."""
        groups: dict[tuple, list[list[int]]] = {}
        for i, t in enumerate(tensors):
            upload_type = self._upload_type(t)
            chunks = groups.setdefault((upload_type, t.shape[0]), [[]])
            if len(chunks[-1]) == MAX_PARTS:
                chunks.append([])
            chunks[-1].append(i)
        return [chunk for chunks in groups.values() for chunk in chunks]

    def _stack(self, tensors: list[QTensor], biases: list) -> DeviceLinear:
        n_rows = sum(t.shape[1] for t in tensors)
        data = self._device_bytes(tensors)
        bias = None
        if any(b is not None for b in biases):
            bias = self.f32(np.concatenate([np.zeros(t.shape[1], np.float32) if b is None else b
                                            for t, b in zip(tensors, biases)]))  # (n_rows,)
        matrix = DeviceQuantMatrix(data, self._upload_type(tensors[0]), tensors[0].shape[0], n_rows)
        return DeviceLinear(matrix, bias)

    def linear(self, weight: QTensor, bias: QTensor | None = None,
               prefill: bool = False) -> DeviceLinear:
        """prefill: the linear may keep an f16 copy (see with_half)."""
        dev_bias = self.vector(bias) if bias is not None else None
        return self.with_half(DeviceLinear(self.matrix(weight), dev_bias), prefill)

    def with_half(self, lin: DeviceLinear, prefill: bool) -> DeviceLinear:
        """lin with an f16 copy of its weights when asked (prefill), enabled (f16_copies) and
        worth it: a dense matrix gemm_f16 takes, of at least F16_COPY_MIN_ROWS rows."""
        w = lin.matrix
        if prefill and self.f16_copies and w.n_rows >= F16_COPY_MIN_ROWS \
                and gemm_f16.supports(w):
            lin.half = gemm_f16.dequantize(w, self.stream)
            self.half_bytes += 2 * w.n_rows * w.k
        return lin

    def vector(self, t: QTensor):
        """A small tensor (norm, bias, per-head parameter) as float32 on the device."""
        return self.f32(t.as_f32())

    def f32(self, a: np.ndarray):
        dev = cuda.to_device(np.ascontiguousarray(a, np.float32), stream=self.stream)
        self._advance(dev.nbytes)
        return dev


def _host_bytes(t: QTensor, exact: bool) -> np.ndarray:
    """t's bytes as uploaded: its GGUF bytes, or its rows dequantized to F32 in exact mode."""
    raw = np.ascontiguousarray(t.raw)
    if exact and t.ggml_type != GGMLType.F32:
        raw = dequantize(raw, t.ggml_type, t.shape[0])
    return raw.reshape(-1).view(np.uint8)


def one_row(t: QTensor) -> QTensor:
    """A (k,) vector as a one-row F32 matrix (a stack member beside the matrices of its input)."""
    values = np.ascontiguousarray(t.as_f32(), np.float32).reshape(1, -1)  # (1, k)
    return QTensor(t.name, GGMLType.F32, (values.shape[1], 1), values)


def upload_progress(console: Console | None) -> Progress:
    return Progress(TextColumn("uploading weights"), BarColumn(), DownloadColumn(),
                    TimeElapsedColumn(), console=console, transient=True)

