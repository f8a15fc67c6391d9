"""load_runtime_model: the settings generate / serve / bench load a model with."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.model.loader import load_runtime_model

TINY_QWEN3 = Path(__file__).parent.parent / "fixtures" / "tiny" / "qwen3" / "qwen3-Q8_0.gguf"


def test_kv_int8_on_the_cpu_warns_and_keeps_an_f16_cache(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        model = load_runtime_model(GGUFFile(TINY_QWEN3), "cpu", {"SPARKINFER_KV_INT8": "1"})
    assert "SPARKINFER_KV_INT8" in caplog.text
    cache = model.create_cache(2, 16, 1)
    assert cache.k.dtype == cache.v.dtype == np.float16


def test_without_kv_int8_nothing_is_logged(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        load_runtime_model(GGUFFile(TINY_QWEN3), "cpu", {})
    assert "SPARKINFER_KV_INT8" not in caplog.text


def test_every_supported_architecture_has_a_tensor_layout():
    """model/tensors.py's layouts and the config's architecture lists name the same ones."""
    from sparkinfer_cli.model.config import HYBRID_ARCHITECTURES, SUPPORTED_ARCHITECTURES
    from sparkinfer_cli.model.tensors import LAYOUTS

    assert set(LAYOUTS) == set(SUPPORTED_ARCHITECTURES)
    assert {arch for arch, layout in LAYOUTS.items() if layout.hybrid} == \
        set(HYBRID_ARCHITECTURES)
