"""The GGUF reader against files written by gguf-py's GGUFWriter (and read by its GGUFReader), the demo model,
and damaged files."""

import struct
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGMLQuantizationType

from rbee_worker.errors import ModelLoadError
from rbee_worker.loading.gguf.gguf_format import GGUFTensorInfo, read_gguf

T = GGMLQuantizationType
V = GGUFValueType

# key -> (value, GGUF type, element type for arrays); one of each value type, arrays of each element kind.
METADATA: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {
    "test.u8": (200, V.UINT8, None),
    "test.i8": (-100, V.INT8, None),
    "test.u16": (60000, V.UINT16, None),
    "test.i16": (-30000, V.INT16, None),
    "test.u32": (4_000_000_000, V.UINT32, None),
    "test.i32": (-2_000_000_000, V.INT32, None),
    "test.f32": (0.1, V.FLOAT32, None),
    "test.u64": (2**63 + 5, V.UINT64, None),
    "test.i64": (-(2**62), V.INT64, None),
    "test.f64": (0.1, V.FLOAT64, None),
    "test.true": (True, V.BOOL, None),
    "test.false": (False, V.BOOL, None),
    "test.str": ("héllo ✓ wörld", V.STRING, None),
    "test.empty_str": ("", V.STRING, None),
    "test.strs": (["a", "", "Ġthe", "日本語", "x" * 300], V.ARRAY, None),
    "test.i32s": ([1, -2, 3, 2**31 - 1], V.ARRAY, V.INT32),
    "test.u8s": ([0, 1, 255], V.ARRAY, V.UINT8),
    "test.f32s": ([0.5, -1.25, 3.0], V.ARRAY, V.FLOAT32),
    "test.f64s": ([0.1, 1e300], V.ARRAY, V.FLOAT64),
    "test.bools": ([True, False, True], V.ARRAY, V.BOOL),
    "test.nested": ([[1, 2, 3], [4], [5, 6]], V.ARRAY, None),
}


def f32(value: float) -> float:
    """What a float32 field holds for `value`."""
    return float(np.float32(value))


EXPECTED_METADATA = {key: value for key, (value, _, _) in METADATA.items()}
EXPECTED_METADATA["test.f32"] = f32(0.1)


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]], alignment: int = 0) -> Path:
    """Write METADATA and `tensors` ({name: (float values, type)}) with gguf-py's writer."""
    writer = GGUFWriter(path, arch="llama")
    if alignment:
        writer.add_custom_alignment(alignment)
    for key, (value, vtype, sub_type) in METADATA.items():
        writer.add_key_value(key, value, vtype, sub_type)
    for name, (values, ggml_type) in tensors.items():
        packed = gguf.quants.quantize(values, ggml_type)
        if ggml_type in (T.F32, T.F16):
            writer.add_tensor(name, packed)
        else:
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def small_tensors() -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
    rng = np.random.default_rng(0)
    return {
        "norm.weight": (rng.standard_normal(7).astype(np.float32), T.F32),
        "proj.weight": (rng.standard_normal((3, 5)).astype(np.float32), T.F16),
        "embd.weight": (rng.standard_normal((4, 2, 64)).astype(np.float32), T.Q8_0),
        "ffn.weight": (rng.standard_normal((6, 96)).astype(np.float32), T.Q4_0),
    }


@pytest.fixture
def small_gguf(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "small.gguf", small_tensors())


def test_metadata_values_and_types_round_trip(small_gguf: Path) -> None:
    f = read_gguf(small_gguf)

    assert f.path == small_gguf
    assert f.metadata["general.architecture"] == "llama"
    for key, expected in EXPECTED_METADATA.items():
        assert f.metadata[key] == expected, key
        assert type(f.metadata[key]) is type(expected), key
    assert type(f.metadata["test.bools"][0]) is bool
    assert type(f.metadata["test.f32s"][0]) is float
    assert list(f.metadata) == ["general.architecture", *METADATA]  # file order


def test_metadata_matches_gguf_reader(small_gguf: Path) -> None:
    f = read_gguf(small_gguf)
    reader = GGUFReader(small_gguf)

    fields = {key: field for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert list(fields) == list(f.metadata)
    for key, field in fields.items():
        if key != "test.nested":  # GGUFReader flattens nested arrays
            assert f.metadata[key] == field.contents(), key


def test_tensor_table_shapes_are_pytorch_order(small_gguf: Path) -> None:
    f = read_gguf(small_gguf)
    reader = GGUFReader(small_gguf)

    assert list(f.tensors) == ["norm.weight", "proj.weight", "embd.weight", "ffn.weight"]
    for ref in reader.tensors:
        info = f.tensors[ref.name]
        assert info == GGUFTensorInfo(ref.name, ref.tensor_type, info.shape, ref.data_offset, ref.n_bytes)
        assert info.shape == tuple(reversed(ref.shape.tolist()))
    assert f.tensors["proj.weight"].shape == (3, 5)
    assert f.tensors["embd.weight"].shape == (4, 2, 64)
    assert f.tensors["ffn.weight"].nbytes == 6 * 3 * 18


def test_load_returns_the_written_values(small_gguf: Path) -> None:
    f = read_gguf(small_gguf)

    for name, (values, ggml_type) in small_tensors().items():
        expected = gguf.quants.dequantize(gguf.quants.quantize(values, ggml_type), ggml_type)
        loaded = f.load(name)
        assert loaded.dtype == torch.float32
        assert torch.equal(loaded, torch.from_numpy(np.array(expected, dtype=np.float32))), name
    # Plain float tensors come back exactly as written.
    assert torch.equal(f.load("norm.weight"), torch.from_numpy(small_tensors()["norm.weight"][0]))
    assert f.load("proj.weight", torch.float16).dtype == torch.float16


def test_raw_is_a_zero_copy_view_of_the_file(small_gguf: Path) -> None:
    f = read_gguf(small_gguf)
    file_bytes = small_gguf.read_bytes()

    first, second = f.tensors["norm.weight"], f.tensors["embd.weight"]
    raw = f.raw("embd.weight")
    assert raw.dtype == torch.uint8
    assert raw.shape == (second.nbytes,)
    assert raw.numpy().tobytes() == file_bytes[second.offset : second.offset + second.nbytes]
    # Both views point into the same mapping, exactly as far apart as in the file.
    assert raw.data_ptr() - f.raw("norm.weight").data_ptr() == second.offset - first.offset


def test_tensor_views_outlive_the_file_object(small_gguf: Path) -> None:
    f = read_gguf(small_gguf)
    raw = f.raw("norm.weight")
    expected = raw.clone()
    del f

    assert torch.equal(raw, expected)


def test_custom_alignment_is_honoured(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "aligned.gguf", small_tensors(), alignment=256)

    f = read_gguf(path)

    assert f.metadata["general.alignment"] == 256
    assert all(info.offset % 256 == 0 for info in f.tensors.values())
    reader = GGUFReader(path)
    for ref in reader.tensors:
        expected = gguf.quants.dequantize(ref.data, ref.tensor_type).reshape(f.tensors[ref.name].shape)
        assert torch.equal(f.load(ref.name), torch.from_numpy(np.array(expected, dtype=np.float32)))


def test_version_2_reads_like_version_3(small_gguf: Path, tmp_path: Path) -> None:
    data = bytearray(small_gguf.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    path = tmp_path / "v2.gguf"
    path.write_bytes(data)

    f = read_gguf(path)

    assert f.metadata == read_gguf(small_gguf).metadata
    assert torch.equal(f.load("ffn.weight"), read_gguf(small_gguf).load("ffn.weight"))


def test_invalid_utf8_is_replaced(tmp_path: Path) -> None:
    writer = GGUFWriter(tmp_path / "utf8.gguf", arch="llama")
    writer.add_key_value("test.bad", b"ok\xff\xfe!", V.STRING)
    writer.add_key_value("test.bad_list", [b"\xc3", b"fine"], V.ARRAY, V.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()

    f = read_gguf(tmp_path / "utf8.gguf")

    assert f.metadata["test.bad"] == "ok\ufffd\ufffd!"
    assert f.metadata["test.bad_list"] == ["\ufffd", "fine"]
    assert f.tensors == {}


def test_unknown_tensor_name_is_a_model_load_error(small_gguf: Path) -> None:
    f = read_gguf(small_gguf)

    with pytest.raises(ModelLoadError, match=r"small\.gguf: the model has no tensor 'missing\.weight'"):
        f.load("missing.weight")


def test_known_but_unsupported_type_opens_and_fails_on_load(tmp_path: Path) -> None:
    writer = GGUFWriter(tmp_path / "iq.gguf", arch="llama")
    writer.add_tensor("w", np.zeros((2, 18), dtype=np.uint8), raw_shape=(2, 18), raw_dtype=T.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    f = read_gguf(tmp_path / "iq.gguf")

    assert f.tensors["w"].shape == (2, 32)
    with pytest.raises(ModelLoadError, match=r"iq\.gguf: tensor 'w': GGML type IQ4_NL is not supported by rbee-worker"):
        f.load("w")


# The demo model.


def test_demo_model_opens_fast(demo_gguf: Path) -> None:
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        read_gguf(demo_gguf)
        timings.append(time.perf_counter() - start)
    assert min(timings) < 0.2  # measured ~0.04 s; gguf.GGUFReader takes ~2.5 s


def test_demo_model_matches_gguf_reader(demo_gguf: Path) -> None:
    f = read_gguf(demo_gguf)
    reader = GGUFReader(demo_gguf)

    assert f.metadata["general.architecture"] == "llama"
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(f.metadata["tokenizer.ggml.merges"]) == 48900
    assert f.metadata["tokenizer.ggml.tokens"] == reader.fields["tokenizer.ggml.tokens"].contents()
    assert f.metadata["tokenizer.ggml.token_type"] == reader.fields["tokenizer.ggml.token_type"].contents()
    assert len(f.tensors) == 272
    assert f.tensors["token_embd.weight"].shape == (49152, 576)
    assert list(f.tensors) == [t.name for t in reader.tensors]
    for ref in reader.tensors:
        info = f.tensors[ref.name]
        assert (info.ggml_type, info.offset, info.nbytes) == (ref.tensor_type, ref.data_offset, ref.n_bytes)
        expected = np.array(gguf.quants.dequantize(ref.data, ref.tensor_type), dtype=np.float32)
        assert torch.equal(f.load(ref.name), torch.from_numpy(expected).reshape(info.shape)), ref.name


# Damaged and foreign files.


def damaged(tmp_path: Path, source: Path, edit: Any) -> Path:
    """A copy of `source` with `edit(bytearray)` applied."""
    data = bytearray(source.read_bytes())
    edit(data)
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data)
    return path


def layout(path: Path) -> dict[str, int]:
    """Byte positions in a small GGUF, found with gguf-py's reader."""
    reader = GGUFReader(path)
    first_tensor = reader.tensors[0].field
    name_len = len(first_tensor.name.encode())
    n_dims = len(reader.tensors[0].shape)
    return {
        "metadata": reader.fields["test.strs"].offset,
        "tensor_table": first_tensor.offset,
        "first_dims": first_tensor.offset + 8 + name_len + 4,
        "first_type": first_tensor.offset + 8 + name_len + 4 + 8 * n_dims,
        "data": reader.data_offset,
        "data_end": reader.tensors[-1].data_offset + reader.tensors[-1].n_bytes,  # before the final padding
    }


@pytest.mark.parametrize(
    ("cut", "match"),
    [
        (lambda at: 6, "truncated: it ends inside the header"),
        (lambda at: 20, "truncated: it ends inside the header"),
        (lambda at: 24 + 3, "truncated: it ends inside the metadata"),
        (lambda at: at["metadata"] + 30, r"truncated: it ends inside the metadata \(key 'test.strs'\)"),
        (lambda at: at["tensor_table"] + 5, "truncated: it ends inside the tensor table"),
        (lambda at: at["first_type"] + 2, r"truncated: it ends inside the tensor table \(tensor 'norm.weight'\)"),
        (lambda at: at["data"], "truncated: tensor 'norm.weight' needs bytes up to"),
        (lambda at: at["data"] + 40, "truncated: tensor 'proj.weight' needs bytes up to"),
        (lambda at: at["data_end"] - 1, "truncated: tensor 'ffn.weight' needs bytes up to"),
    ],
    ids=["magic+2", "counts", "kv-count", "string-array", "table", "tensor-type", "data", "mid-data", "last-byte"],
)
def test_truncated_files_are_reported(small_gguf: Path, tmp_path: Path, cut: Any, match: str) -> None:
    at = cut(layout(small_gguf))
    path = damaged(tmp_path, small_gguf, lambda data: data.__delitem__(slice(at, None)))

    with pytest.raises(ModelLoadError, match=f"damaged.gguf is {match}") as excinfo:
        read_gguf(path)
    assert "\n" not in str(excinfo.value)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b'{"__metadata__": {}}' + bytes(100))

    expected = r"model\.safetensors is not a GGUF file \(it starts with b'\{\"__'\); pass a \.gguf model file"
    with pytest.raises(ModelLoadError, match=expected):
        read_gguf(path)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").touch()
    with pytest.raises(ModelLoadError, match=r"empty\.gguf is empty"):
        read_gguf(tmp_path / "empty.gguf")
    with pytest.raises(ModelLoadError, match=r"cannot open model file .*nothing\.gguf: No such file"):
        read_gguf(tmp_path / "nothing.gguf")
    with pytest.raises(ModelLoadError, match="cannot open model file"):
        read_gguf(tmp_path)


@pytest.mark.parametrize(
    ("version", "match"),
    [
        (struct.pack("<I", 1), "is GGUF version 1, but rbee-worker reads versions 2 and 3"),
        (struct.pack("<I", 4), "is GGUF version 4"),
        (struct.pack(">I", 3), "is a big-endian GGUF"),
    ],
)
def test_unsupported_versions(small_gguf: Path, tmp_path: Path, version: bytes, match: str) -> None:
    path = damaged(tmp_path, small_gguf, lambda data: data.__setitem__(slice(4, 8), version))

    with pytest.raises(ModelLoadError, match=match):
        read_gguf(path)


def test_unknown_ggml_type(small_gguf: Path, tmp_path: Path) -> None:
    at = layout(small_gguf)["first_type"]
    path = damaged(tmp_path, small_gguf, lambda data: data.__setitem__(slice(at, at + 4), struct.pack("<I", 77)))

    with pytest.raises(ModelLoadError, match=r"tensor 'norm\.weight' has unknown GGML type 77"):
        read_gguf(path)


def test_misaligned_tensor_offset(small_gguf: Path, tmp_path: Path) -> None:
    at = layout(small_gguf)["first_type"] + 4  # the u64 data offset follows the u32 type
    path = damaged(tmp_path, small_gguf, lambda data: data.__setitem__(slice(at, at + 8), struct.pack("<Q", 4)))

    with pytest.raises(ModelLoadError, match="starts at data offset 4, not a multiple of the alignment 32"):
        read_gguf(path)


def test_duplicate_tensor_name(small_gguf: Path, tmp_path: Path) -> None:
    # Rename proj.weight (same length) to norm.weight.
    second = GGUFReader(small_gguf).tensors[1].field.offset + 8
    path = damaged(tmp_path, small_gguf, lambda data: data.__setitem__(slice(second, second + 11), b"norm.weight"))

    with pytest.raises(ModelLoadError, match=r"has two tensors named 'norm\.weight'; the file is corrupt"):
        read_gguf(path)


def test_tensor_larger_than_its_space(small_gguf: Path, tmp_path: Path) -> None:
    # norm.weight is F32 with 7 values; claim 100, which runs into proj.weight's data.
    at = layout(small_gguf)["first_dims"]
    path = damaged(tmp_path, small_gguf, lambda data: data.__setitem__(slice(at, at + 8), struct.pack("<Q", 100)))

    expected = r"tensor 'norm\.weight' \(F32, shape \(100,\)\) needs 400 bytes but tensor 'proj\.weight' starts"
    with pytest.raises(ModelLoadError, match=expected):
        read_gguf(path)


def test_quantized_row_not_whole_blocks(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "rows.gguf", {"w": (np.zeros((2, 64), dtype=np.float32), T.Q8_0)})
    at = layout(path)["first_dims"]
    # Rows of 48 values would split a 32-value Q8_0 block.
    path = damaged(tmp_path, path, lambda data: data.__setitem__(slice(at, at + 8), struct.pack("<Q", 48)))

    with pytest.raises(ModelLoadError, match=r"tensor 'w' has shape \(2, 48\), but Q8_0 rows must be a multiple of 32"):
        read_gguf(path)


@pytest.mark.parametrize("alignment", [0, 48])
def test_bad_alignment(tmp_path: Path, alignment: int) -> None:
    writer = GGUFWriter(tmp_path / "align.gguf", arch="llama")
    writer.add_uint32("general.alignment", alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()

    with pytest.raises(ModelLoadError, match=f"has general.alignment {alignment}, which is not a power of two"):
        read_gguf(tmp_path / "align.gguf")


def test_unknown_metadata_value_type(small_gguf: Path, tmp_path: Path) -> None:
    # The value type of the first key (general.architecture) follows its 8-byte length and 20-byte name.
    at = 24 + 8 + len(b"general.architecture")
    path = damaged(tmp_path, small_gguf, lambda data: data.__setitem__(slice(at, at + 4), struct.pack("<I", 13)))

    with pytest.raises(ModelLoadError, match="has unknown metadata value type 13; the file is corrupt"):
        read_gguf(path)


def test_huge_array_count_fails_fast(small_gguf: Path, tmp_path: Path) -> None:
    # test.strs: key length, key, value type, element type, then the u64 element count.
    at = layout(small_gguf)["metadata"] + 8 + len(b"test.strs") + 4 + 4
    path = damaged(tmp_path, small_gguf, lambda data: data.__setitem__(slice(at, at + 8), struct.pack("<Q", 2**60)))

    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"truncated: it ends inside the metadata \(key 'test.strs'\)"):
        read_gguf(path)
    assert time.perf_counter() - start < 1
