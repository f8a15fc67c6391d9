"""Loading a model on the CUDA backend (in the simulator): straight from the file's tensor records,
never through the CPU model, with every whole file tensor read from the file through the pinned
staging (FileUploader) rather than the memory map, and its device bytes equal to the file's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sparkinfer_cli.backend.cuda.model import load_cuda_model
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.gguf.synthetic import write_synthetic
from sparkinfer_cli.kernels.cuda.runtime.file_upload import FileUploader
from sparkinfer_cli.model.base import CausalLM
from sparkinfer_cli.model.config import ModelConfig

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"


def _file(which: str, tmp_path: Path) -> Path:
    if which.startswith("tiny-"):  # a synthetic preset (qwen2: q/k/v biases)
        return Path(write_synthetic(tmp_path / "model.gguf", which, seed=3))
    family, variant = which.split(":")
    return TINY / family / f"{family}-{variant}.gguf"


@pytest.mark.parametrize("which", ["qwen35moe:Q4_K_M", "qwen3next:Q8_0", "qwen3moe:Q8_0",
                                   "tiny-qwen2"])
def test_a_gpu_model_loads_from_the_file_without_the_cpu_model(which, tmp_path, monkeypatch):
    def no_cpu_model(*args, **kwargs):
        raise AssertionError("the CUDA load built the CPU model")

    monkeypatch.setattr(CausalLM, "__init__", no_cpu_model)
    spans: list[tuple[int, int]] = []
    upload_ranges = FileUploader.upload_ranges
    monkeypatch.setattr(FileUploader, "upload_ranges",
                        lambda self, ranges: spans.extend(ranges) or upload_ranges(self, ranges))
    gguf = GGUFFile(_file(which, tmp_path))
    model = load_cuda_model(gguf, ModelConfig.from_gguf(gguf))

    # the big tensors came from the file, not the map: every expert stack and the output matrix
    big = [info for name, info in gguf.tensors.items()
           if name.endswith(("_exps.weight", "output.weight", "ffn_down.weight"))]
    assert big and all((info.offset, info.n_bytes) in spans for info in big)
    # and hold the file's bytes, zero-padded
    output = "token_embd.weight" if "output.weight" not in gguf.tensors else "output.weight"
    down = next(n for n in ("blk.0.ffn_down.weight", "blk.0.ffn_down_exps.weight")
                if n in gguf.tensors)
    for name, matrix in ((output, model.output.matrix), (down, model.layers[0].ffn.down.matrix)):
        raw = np.asarray(gguf.raw(name)).reshape(-1).view(np.uint8)
        data = np.asarray(matrix.data.copy_to_host())
        np.testing.assert_array_equal(data[:raw.size], raw)
        assert not data[raw.size:].any()
