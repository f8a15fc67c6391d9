"""GGUFFile against gguf's own reader, and its errors on broken files."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest

from sparkinfer_cli.gguf.reader import GGUFError, GGUFFile
from sparkinfer_cli.model.loader import load_model

TINY = "tiny/qwen3/qwen3-Q4_K_M.gguf"


@pytest.fixture()
def tiny_copy(fixtures_dir, tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copy(fixtures_dir / TINY, path)
    return path


def test_metadata_and_tensors_equal_gguf_reader(fixtures_dir):
    path = fixtures_dir / TINY
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == pytest.approx(field.contents()), key
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        info = ours.tensor(t.name)
        assert info.ggml_type == int(t.tensor_type) and list(info.shape) == t.shape.tolist()
        assert np.array_equal(ours.raw(t.name), np.asarray(t.data)), t.name


def test_not_a_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip file")
    with pytest.raises(GGUFError, match=r"x\.gguf: not a GGUF file"):
        GGUFFile(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "absent.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="empty.gguf"):
        GGUFFile(tmp_path / "empty.gguf")


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_file(tiny_copy, keep):
    data = tiny_copy.read_bytes()
    tiny_copy.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(tiny_copy)


def write_variant(src, dst, *, arch=None, drop=None, retype=None, reshape=None):
    """Copy of a GGUF with one change: architecture, a dropped tensor, or a replaced one."""
    reader = gguf.GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        key = key.replace(f"{old_arch}.", f"{arch}.") if arch else key
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name == drop:
            continue
        if t.name == retype:  # same element shape, encoded as Q2_K (84 bytes per 256 elements)
            rows, ne0 = int(np.prod(t.shape[1:])), int(t.shape[0])
            blocks = np.random.default_rng(0).integers(0, 255, (rows, ne0 // 256 * 84), np.uint8)
            writer.add_tensor(t.name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        elif t.name == reshape:
            writer.add_tensor(t.name, np.asarray(t.data, dtype=np.float32)[:-1].copy())
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_unsupported_architecture(fixtures_dir, tmp_path):
    path = write_variant(fixtures_dir / TINY, tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(GGUFError, match="unsupported architecture 'gpt2'"):
        load_model(path)


def test_missing_tensor(fixtures_dir, tmp_path):
    path = write_variant(fixtures_dir / TINY, tmp_path / "m.gguf", drop="blk.1.ffn_up.weight")
    with pytest.raises(GGUFError, match="missing tensor 'blk.1.ffn_up.weight'"):
        load_model(path)


def test_misshaped_tensor(fixtures_dir, tmp_path):
    path = write_variant(fixtures_dir / "tiny/qwen3/qwen3-F32.gguf", tmp_path / "m.gguf",
                         reshape="blk.0.attn_k.weight")
    with pytest.raises(GGUFError, match=r"'blk.0.attn_k.weight' has shape \[256, 127\]"):
        load_model(path)


def test_unsupported_tensor_type_names_the_tensor(fixtures_dir, tmp_path):
    path = write_variant(fixtures_dir / TINY, tmp_path / "m.gguf", retype="blk.1.attn_q.weight")
    with pytest.raises(GGUFError, match="tensor 'blk.1.attn_q.weight' has type Q2_K"):
        load_model(path)
