"""FileUploader: file byte ranges through pinned staging buffers equal to_device_bytes of the same
bytes (zero padding included), over chunk boundaries, buffer reuse and several ranges at once."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda.runtime import file_upload
from sparkinfer_cli.kernels.cuda.runtime.file_upload import FileUploader, chunk_pieces
from sparkinfer_cli.kernels.cuda.runtime.launch import to_device_bytes

CHUNK = 4096
FILE_BYTES = 5 * CHUNK + 123


@pytest.fixture
def data_file(tmp_path, rng) -> tuple[str, np.ndarray]:
    """A file of random bytes, none of them zero, so a missing copy or padding shows."""
    data = rng.integers(1, 256, FILE_BYTES, dtype=np.uint8)  # (FILE_BYTES,)
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    return str(path), data


@pytest.fixture
def poisoned_device_arrays(monkeypatch) -> None:
    """New device arrays start as 0xAB, not as whatever memory held: padding must be written."""
    original = cuda.device_array

    def device_array(shape, dtype, stream=0):
        dev = original(shape, dtype, stream=stream)
        dev.copy_to_device(np.full(shape, 0xAB, dtype), stream=stream)
        return dev

    monkeypatch.setattr(file_upload.cuda, "device_array", device_array)


@pytest.fixture
def small_read_slices(monkeypatch) -> None:
    """Chunks are read as several slices (by several threads), not one."""
    monkeypatch.setattr(file_upload, "READ_SLICE", 1000)


def assert_same_upload(dev, raw: np.ndarray, stream) -> None:
    want = to_device_bytes(raw, stream).copy_to_host(stream=stream)
    got = dev.copy_to_host(stream=stream)
    stream.synchronize()
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.array_equal(got[:raw.size], raw)
    assert not got[raw.size:].any(), "the padding past the data is not zero"
    np.testing.assert_array_equal(got, want)


@pytest.mark.usefixtures("poisoned_device_arrays", "small_read_slices")
@pytest.mark.parametrize("read_threads", [1, 3])
@pytest.mark.parametrize("offset, n_bytes", [
    (0, 0), (FILE_BYTES, 0), (17, 1), (FILE_BYTES - 1, 1), (0, CHUNK), (3, CHUNK),
    (5, CHUNK + 1), (1, 3 * CHUNK + 7), (0, FILE_BYTES), (4095, FILE_BYTES - 4095 - 9),
])
def test_upload_equals_to_device_bytes(data_file, offset, n_bytes, read_threads):
    path, data = data_file
    stream = cuda.stream()
    with FileUploader(path, stream, chunk_bytes=CHUNK, read_threads=read_threads) as up:
        dev = up.upload(offset, n_bytes)
        assert_same_upload(dev, data[offset:offset + n_bytes], stream)


@pytest.mark.usefixtures("poisoned_device_arrays", "small_read_slices")
def test_many_uploads_reuse_the_staging_buffers(data_file, rng):
    """Uploads in a row alternate the two buffers; each result stays what it was."""
    path, data = data_file
    stream = cuda.stream()
    ranges = [(int(o), int(n)) for o, n in zip(rng.integers(0, FILE_BYTES // 2, 12),
                                                rng.integers(0, FILE_BYTES // 2, 12))]
    with FileUploader(path, stream, chunk_bytes=CHUNK) as up:
        devs = [up.upload(o, n) for o, n in ranges]
    for dev, (o, n) in zip(devs, ranges):
        assert_same_upload(dev, data[o:o + n], stream)


@pytest.mark.usefixtures("poisoned_device_arrays", "small_read_slices")
def test_upload_ranges_concatenates(data_file):
    path, data = data_file
    stream = cuda.stream()
    ranges = [(11, CHUNK - 5), (3 * CHUNK + 1, 2 * CHUNK + 3), (0, 0), (7, 1), (100, 9)]
    with FileUploader(path, stream, chunk_bytes=CHUNK) as up:
        dev = up.upload_ranges(ranges)
    assert_same_upload(dev, np.concatenate([data[o:o + n] for o, n in ranges]), stream)


def test_default_chunk_and_default_stream(data_file):
    path, data = data_file
    with FileUploader(path, 0) as up:
        dev = up.upload(9, 1000)
    np.testing.assert_array_equal(dev.copy_to_host()[:1000], data[9:1009])


def test_chunk_pieces_cut_ranges_at_chunk_boundaries():
    assert chunk_pieces([], 10) == [[]]
    assert chunk_pieces([(5, 0)], 10) == [[]]
    assert chunk_pieces([(0, 10)], 10) == [[(0, 10)]]
    assert chunk_pieces([(3, 25)], 10) == [[(3, 10)], [(13, 10)], [(23, 5)]]
    assert chunk_pieces([(0, 4), (100, 8), (50, 10)], 10) == \
        [[(0, 4), (100, 6)], [(106, 2), (50, 8)], [(58, 2)]]


@pytest.mark.parametrize("offset, n_bytes", [(0, FILE_BYTES + 1), (FILE_BYTES, 1), (-1, 4),
                                             (5, -1)])
def test_range_outside_the_file_raises(data_file, offset, n_bytes):
    path, _ = data_file
    with FileUploader(path, cuda.stream(), chunk_bytes=CHUNK) as up:
        with pytest.raises(ValueError, match="weights.bin.*outside the file"):
            up.upload(offset, n_bytes)


@pytest.mark.usefixtures("small_read_slices")
@pytest.mark.parametrize("read_threads", [1, 3])
def test_short_read_raises(data_file, read_threads):
    """The file shrinks after the uploader measured it."""
    path, _ = data_file
    with FileUploader(path, cuda.stream(), chunk_bytes=CHUNK, read_threads=read_threads) as up:
        with open(path, "r+b") as f:
            f.truncate(FILE_BYTES - 100)
        with pytest.raises(OSError, match="weights.bin: short read"):
            up.upload(CHUNK, FILE_BYTES - CHUNK)


def test_closed_uploader_raises_and_close_twice_is_fine(data_file):
    path, _ = data_file
    up = FileUploader(path, cuda.stream(), chunk_bytes=CHUNK)
    up.close()
    up.close()
    with pytest.raises(ValueError, match="closed"):
        up.upload(0, 1)


def test_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        FileUploader(tmp_path / "nothing.gguf", cuda.stream())
