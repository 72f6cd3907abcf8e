"""A fast GGUF reader: header, metadata and tensor table parsed straight out of an mmap of the file.

`gguf.GGUFReader` builds a numpy view per metadata item (slow for a large vocabulary); here scalars go
through `struct`, numeric arrays through one `numpy.frombuffer` each and strings through a tight loop, and tensor
data stays in the mmap until `load` dequantizes it.

Layout (little-endian, versions 2 and 3): magic "GGUF", u32 version, u64 tensor count, u64 metadata count, the
metadata key/values, the tensor table (name, u32 n_dims, u64 dims innermost first, u32 type, u64 offset), then
padding to `general.alignment` and the tensor data, each tensor at its offset from the start of that data.
"""

import itertools
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from rbee_worker.errors import ModelLoadError
from rbee_worker.loading.gguf.dequant import dequantize, type_name

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALARS: dict[int, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32,
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: _U64,
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_ARRAY_DTYPES: dict[int, np.dtype[Any]] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),  # any non-zero byte is true
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# Smallest encoding of one array element of each non-numeric type: a string's length; a nested array's type + length.
_MIN_ELEMENT_SIZE = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # PyTorch order: the GGUF dims reversed
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """An opened GGUF file: its metadata, its tensor table and zero-copy access to the tensor bytes."""

    def __init__(
        self, path: Path, metadata: dict[str, Any], tensors: dict[str, GGUFTensorInfo], data: torch.Tensor
    ) -> None:
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self._data = data  # the whole file as uint8; it keeps the mmap alive

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {len(self.metadata)} metadata keys, {len(self.tensors)} tensors)"

    def _info(self, name: str) -> GGUFTensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            message = f"{self.path.name}: the model has no tensor {name!r}; the file is incomplete"
            raise ModelLoadError(message) from None

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes: a 1-D uint8 view into the read-only mmap (no copy). Never write to it."""
        info = self._info(name)
        return self._data[info.offset : info.offset + info.nbytes]

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor dequantized into a new `dtype` tensor of `shape` (bit-exact with gguf-py in float32)."""
        info = self._info(name)
        try:
            return dequantize(self.raw(name), info.ggml_type, info.shape, dtype)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{self.path.name}: tensor {name!r}: {exc}") from exc


class _Truncated(Exception):
    """A read ran past the end of the file."""


class _Corrupt(Exception):
    """The file cannot be read as GGUF; the message (which follows the file name) says why and what to do."""


class _Parser:
    """Sequential little-endian reads from the mmap; every read checks the end of the file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def _take(self, n: int) -> int:
        """Consume n bytes and return where they start."""
        start = self.pos
        if start + n > self.size:
            raise _Truncated
        self.pos = start + n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self._take(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self._take(8))[0]

    def u64s(self, count: int) -> tuple[int, ...]:
        return struct.unpack_from(f"<{count}Q", self.buf, self._take(8 * count))

    def string(self) -> str:
        length = self.u64()
        start = self._take(length)
        return str(self.buf[start : start + length], "utf-8", "replace")

    def value(self, vtype: int) -> Any:
        if (scalar := _SCALARS.get(vtype)) is not None:
            return scalar.unpack_from(self.buf, self._take(scalar.size))[0]
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        raise _Corrupt(f"has unknown metadata value type {vtype}; the file is corrupt")

    def array(self) -> list[Any]:
        item_type, count = self.u32(), self.u64()
        if (dtype := _ARRAY_DTYPES.get(item_type)) is not None:
            if count == 0:
                return []
            values = np.frombuffer(self.buf, dtype, count, self._take(count * dtype.itemsize))
            return (values != 0).tolist() if item_type == GGUFValueType.BOOL else values.tolist()
        if item_type not in _MIN_ELEMENT_SIZE:
            raise _Corrupt(f"has unknown metadata array element type {item_type}; the file is corrupt")
        # Fail fast on a corrupt count instead of looping over billions of elements.
        if count * _MIN_ELEMENT_SIZE[item_type] > self.size - self.pos:
            raise _Truncated
        if item_type == GGUFValueType.ARRAY:
            return [self.array() for _ in range(count)]
        return self._strings(count)

    def _strings(self, count: int) -> list[str]:
        """A string array; inlined because vocabularies hold ~100k of them."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            end = pos + 8 + unpack(buf, pos)[0]
            if end > size:
                raise _Truncated
            append(str(buf[pos + 8 : end], "utf-8", "replace"))
            pos = end
        self.pos = pos
        return out


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file: parse its header, metadata and tensor table; leave the tensor data in a read-only mmap.

    Raises ModelLoadError (one line naming the file, what is wrong and what to do) for anything but a sound
    GGUF v2/v3 file.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:  # mmap refuses empty files
        raise ModelLoadError(f"{path.name} is empty, not a GGUF model; pass a .gguf model file") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot open model file {path}: {exc.strerror or exc}; check the path") from None

    if buf[:4] != _MAGIC:
        raise ModelLoadError(f"{path.name} is not a GGUF file (it starts with {buf[:4]!r}); pass a .gguf model file")
    parser = _Parser(buf)
    where = "header"
    try:
        parser.pos = 4
        version = parser.u32()
        if version not in _SUPPORTED_VERSIONS:
            if (version & 0xFFFF) == 0 and int.from_bytes(_U32.pack(version), "big") in _SUPPORTED_VERSIONS:
                raise _Corrupt("is a big-endian GGUF, which rbee-worker cannot read; use a little-endian conversion")
            raise _Corrupt(
                f"is GGUF version {version}, but rbee-worker reads versions 2 and 3; "
                "re-convert it with a current llama.cpp"
            )
        n_tensors, n_kv = parser.u64(), parser.u64()

        metadata: dict[str, Any] = {}
        for index in range(n_kv):
            where = f"metadata (entry {index} of {n_kv})"
            key = parser.string()
            where = f"metadata (key {key!r})"
            if key in metadata:
                raise _Corrupt(f"repeats metadata key {key!r}; the file is corrupt")
            metadata[key] = parser.value(parser.u32())

        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise _Corrupt(f"has general.alignment {alignment!r}, which is not a power of two; the file is corrupt")

        table: list[tuple[str, tuple[int, ...], int, int]] = []
        for index in range(n_tensors):
            where = f"tensor table (entry {index} of {n_tensors})"
            name = parser.string()
            where = f"tensor table (tensor {name!r})"
            n_dims = parser.u32()
            if n_dims > _MAX_DIMS:
                raise _Corrupt(
                    f"gives tensor {name!r} {n_dims} dimensions (GGUF allows at most {_MAX_DIMS}); the file is corrupt"
                )
            table.append((name, tuple(reversed(parser.u64s(n_dims))), parser.u32(), parser.u64()))
    except _Truncated:
        raise ModelLoadError(
            f"{path.name} is truncated: it ends inside the {where}; download or convert the model again"
        ) from None
    except _Corrupt as exc:
        raise ModelLoadError(f"{path.name} {exc}") from None

    data_start = -(-parser.pos // alignment) * alignment
    tensors = _tensor_infos(path.name, table, data_start, alignment, len(buf))
    with warnings.catch_warnings():
        # torch warns that it cannot mark tensors read-only; raw() documents that.
        warnings.simplefilter("ignore", UserWarning)
        data = torch.frombuffer(buf, dtype=torch.uint8)
    return GGUFFile(path, metadata, tensors, data)


def _tensor_infos(
    fname: str, table: list[tuple[str, tuple[int, ...], int, int]], data_start: int, alignment: int, file_size: int
) -> dict[str, GGUFTensorInfo]:
    """Check every tensor's type, size and placement and turn the table into GGUFTensorInfo, in file order."""
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, ggml_type, offset in table:
        if name in tensors:
            raise ModelLoadError(f"{fname} has two tensors named {name!r}; the file is corrupt")
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except ValueError:
            raise ModelLoadError(
                f"{fname}: tensor {name!r} has unknown GGML type {ggml_type}; "
                "the file is corrupt or needs a newer rbee-worker"
            ) from None
        n_elements = 1
        for dim in shape:
            n_elements *= dim
        if (shape[-1] if shape else 1) % block_size:
            raise ModelLoadError(
                f"{fname}: tensor {name!r} has shape {shape}, but {type_name(ggml_type)} rows must be a multiple of "
                f"{block_size} values; the file is corrupt"
            )
        if offset % alignment:
            raise ModelLoadError(
                f"{fname}: tensor {name!r} starts at data offset {offset}, not a multiple of the alignment "
                f"{alignment}; the file is corrupt"
            )
        info = GGUFTensorInfo(name, ggml_type, shape, data_start + offset, n_elements // block_size * type_size)
        if info.offset + info.nbytes > file_size:
            raise ModelLoadError(
                f"{fname} is truncated: tensor {name!r} needs bytes up to {info.offset + info.nbytes} but the file has "
                f"{file_size}; download or convert the model again"
            )
        tensors[name] = info

    by_offset = sorted(tensors.values(), key=lambda t: t.offset)
    for info, following in itertools.pairwise(by_offset):
        if info.offset + info.nbytes > following.offset:
            raise ModelLoadError(
                f"{fname}: tensor {info.name!r} ({type_name(info.ggml_type)}, shape {info.shape}) needs {info.nbytes} "
                f"bytes but tensor {following.name!r} starts {following.offset - info.offset} bytes after it; "
                "the file is corrupt"
            )
    return tensors
