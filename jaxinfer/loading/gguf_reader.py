"""The GGUF file reader: header, key/value metadata and tensor infos parsed with `struct` over one memory map,
numeric arrays read in bulk with numpy, tensor data left in the map as numpy views (never copied).

It answers what gguf-py's `GGUFReader` answers (`fields[key].contents()`, `fields[key].types`, `tensors` with
name, tensor_type, shape, n_elements, n_bytes, data_offset, data; `data` the file's `np.memmap`), without one
numpy view per field part: gguf-py takes ~25 s on a 262k-token vocabulary, this reader well under a second.
Differences, on purpose: an array's `types` always names its element type (gguf-py leaves it out of an empty
array), and an array of arrays' `contents()` is nested (gguf-py flattens it).

Every damage is one `GGUFError` naming the file: bad magic, an unsupported version, a value or tensor info
running past the end, counts that cannot fit in the file, unknown types, duplicate keys or tensors, tensor
data past the end. Imports numpy and gguf's constants; no jax.
"""

import math
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)
MAGIC = b"GGUF"

# value type -> (struct format character, numpy dtype character) of a fixed-size scalar
_SCALARS = {
    GGUFValueType.UINT8: ("B", "u1"), GGUFValueType.INT8: ("b", "i1"), GGUFValueType.UINT16: ("H", "u2"),
    GGUFValueType.INT16: ("h", "i2"), GGUFValueType.UINT32: ("I", "u4"), GGUFValueType.INT32: ("i", "i4"),
    GGUFValueType.FLOAT32: ("f", "f4"), GGUFValueType.BOOL: ("?", "?"), GGUFValueType.UINT64: ("Q", "u8"),
    GGUFValueType.INT64: ("q", "i8"), GGUFValueType.FLOAT64: ("d", "f8"),
}
# ggml types whose data gguf-py (and so the callers) see as typed elements; every other type is uint8 blocks
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: "f2", GGMLQuantizationType.F32: "f4", GGMLQuantizationType.F64: "f8",
    GGMLQuantizationType.I8: "i1", GGMLQuantizationType.I16: "i2", GGMLQuantizationType.I32: "i4",
    GGMLQuantizationType.I64: "i8",
}
_MIN_KV_BYTES = 8 + 4  # a key's length and its value type; the smallest tensor info is 8 + 4 + 4 + 8
_MIN_TENSOR_INFO_BYTES = 24


class GGUFError(ValueError):
    """A GGUF file is damaged or of a kind this reader does not read; the message names the file."""


class GGUFField:
    """One metadata value. `types`: [type] for a scalar, [ARRAY, element type, ...] for an array.
    `value`: the raw value: a Python scalar, bytes (STRING), a read-only numpy array (array of numbers),
    a list of bytes (array of strings), or a list of such values (array of arrays)."""

    __slots__ = ("name", "types", "value")

    def __init__(self, name: str, types: list[GGUFValueType], value: Any):
        self.name, self.types, self.value = name, types, value

    def __len__(self) -> int:
        """The number of elements of an array; 1 for a scalar or a string."""
        return len(self.value) if self.types[0] == GGUFValueType.ARRAY else 1

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        """The value as Python objects (str for strings, lists for arrays), as gguf-py's contents() gives it;
        `index_or_slice` picks elements of an array."""
        if self.types[0] != GGUFValueType.ARRAY:
            return self.value.decode("utf-8") if self.types[0] == GGUFValueType.STRING else self.value
        return _python_elements(self.value, self.types[1:], index_or_slice)

    def __repr__(self) -> str:
        return f"GGUFField({self.name!r}, {[t.name for t in self.types]}, {len(self)} element(s))"


def _python_elements(value, types: list[GGUFValueType], index_or_slice: int | slice):
    picked = value[index_or_slice]
    if types[0] == GGUFValueType.STRING:
        return picked.decode("utf-8") if isinstance(index_or_slice, int) else [s.decode("utf-8") for s in picked]
    if types[0] == GGUFValueType.ARRAY:
        inner = lambda v: _python_elements(v, types[1:], slice(None))  # noqa: E731
        return inner(picked) if isinstance(index_or_slice, int) else [inner(v) for v in picked]
    return picked.item() if isinstance(index_or_slice, int) else picked.tolist()


class GGUFTensor(NamedTuple):
    """One tensor info and its data. `shape`: uint64 dims innermost first (GGUF order); `data`: a view into
    the file's memory map, [outermost, ..., innermost] elements for float/int types, uint8 block bytes with
    the innermost dim in bytes for quantized types (as gguf-py shapes it)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute byte offset in the file
    data: np.ndarray


class GGUFFile:
    """A parsed GGUF file. `fields`: key -> GGUFField in file order, after gguf-py's three header
    pseudo-fields (GGUF.version, GGUF.tensor_count, GGUF.kv_count); `tensors`: in file order;
    `data`: the whole file as a read-only uint8 np.memmap, which every tensor's data views."""

    def __init__(self, path: Path, data: np.memmap, version: int, byte_order: str, alignment: int,
                 data_offset: int, fields: dict[str, GGUFField], tensors: list[GGUFTensor]):
        self.path, self.data, self.version, self.byte_order = path, data, version, byte_order
        self.alignment, self.data_offset, self.fields, self.tensors = alignment, data_offset, fields, tensors

    def get_field(self, key: str) -> GGUFField | None:
        return self.fields.get(key)

    def get_tensor(self, index: int) -> GGUFTensor:
        return self.tensors[index]


class _Cursor:
    """Sequential reads from the map, each checked against the file's end; `what` names the read in errors."""

    def __init__(self, buffer, size: int, path: Path, order: str):
        self.buffer, self.size, self.path, self.order, self.pos = buffer, size, path, order, 0

    def fail(self, detail: str) -> GGUFError:
        return GGUFError(f"{self.path} is a corrupt or truncated GGUF file: {detail}")

    def need(self, num_bytes: int, what: str) -> None:
        if self.pos + num_bytes > self.size:
            raise self.fail(f"truncated at byte {self.pos} reading {what} ({num_bytes} bytes needed, the file has {self.size})")

    def scalar(self, fmt: str, what: str):
        self.need(struct.calcsize(fmt), what)
        (value,) = struct.unpack_from(self.order + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def raw_string(self, what: str) -> bytes:
        length = self.scalar("Q", f"the length of {what}")
        self.need(length, what)
        self.pos += length
        return self.buffer[self.pos - length : self.pos]

    def text(self, what: str) -> str:
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} ending at byte {self.pos} is not UTF-8: {raw[:64]!r}") from None

    def count(self, min_bytes_each: int, what: str) -> int:
        """A u64 element count, refused when that many elements cannot fit in the rest of the file."""
        num = self.scalar("Q", f"the count of {what}")
        if num * min_bytes_each > self.size - self.pos:
            raise self.fail(f"{what}: {num} of at least {min_bytes_each} bytes each do not fit in the "
                            f"{self.size - self.pos} bytes after byte {self.pos} (truncated or a damaged count)")
        return num

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.scalar("I", f"the value type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.fail(f"{what} has unknown value type {raw} at byte {self.pos - 4}") from None


def _read_value(cursor: _Cursor, kind: GGUFValueType, what: str) -> tuple[Any, list[GGUFValueType]]:
    """(raw value, types) of one value of type `kind` at the cursor."""
    if kind == GGUFValueType.STRING:
        return cursor.raw_string(what), [kind]
    if kind != GGUFValueType.ARRAY:
        return cursor.scalar(_SCALARS[kind][0], what), [kind]
    element = cursor.value_type(f"the elements of {what}")
    if element == GGUFValueType.STRING:
        return _read_strings(cursor, cursor.count(8, what), what), [kind, element]
    if element != GGUFValueType.ARRAY:
        return _read_numbers(cursor, element, what), [kind, element]
    values, types = [], [kind, element]
    for i in range(cursor.count(12, what)):  # an array's smallest encoding: element type + count
        value, inner_types = _read_value(cursor, element, f"element {i} of {what}")
        values.append(value)
        if i == 0:  # as gguf-py: an array of arrays is typed by its first element
            types = [kind, *inner_types]
    return values, types


def _read_numbers(cursor: _Cursor, element: GGUFValueType, what: str) -> np.ndarray:
    dtype = np.dtype(cursor.order + _SCALARS[element][1])
    num = cursor.count(dtype.itemsize, what)
    raw = cursor.buffer[cursor.pos : cursor.pos + num * dtype.itemsize]  # one copy of the array's bytes
    cursor.pos += num * dtype.itemsize
    return np.frombuffer(raw, dtype).astype(dtype.newbyteorder("="), copy=False)


def _read_strings(cursor: _Cursor, num: int, what: str) -> list[bytes]:
    """`num` length-prefixed strings, in one tight loop: the hot path of a vocabulary (262k tokens and
    515k merges for Gemma 4). Slices past the end come back short; the final position catches them."""
    buffer, pos, unpack = cursor.buffer, cursor.pos, struct.Struct(cursor.order + "Q").unpack_from
    out = [b""] * num
    try:
        for i in range(num):
            (length,) = unpack(buffer, pos)
            pos += 8
            out[i] = buffer[pos : pos + length]
            pos += length
    except struct.error:
        raise cursor.fail(f"truncated at byte {pos} reading string {i} of {num} of {what}, the file has {cursor.size}") from None
    if pos > cursor.size:
        raise cursor.fail(f"truncated: the {num} strings of {what} need bytes up to {pos}, the file has {cursor.size}")
    cursor.pos = pos
    return out


def _read_fields(cursor: _Cursor, num_kv: int, fields: dict[str, GGUFField]) -> None:
    for index in range(num_kv):
        key = cursor.text(f"the key of key/value pair {index}")
        kind = cursor.value_type(f"key {key!r}")
        value, types = _read_value(cursor, kind, f"the value of key {key!r}")
        if key in fields:
            raise cursor.fail(f"key {key!r} appears twice (again at key/value pair {index})")
        fields[key] = GGUFField(key, types, value)


def _read_tensor_info(cursor: _Cursor) -> tuple[str, list[int], int, int]:
    name = cursor.text("a tensor name")
    num_dims = cursor.scalar("I", f"the dim count of tensor {name!r}")
    cursor.need(8 * num_dims, f"the dims of tensor {name!r}")
    dims = list(struct.unpack_from(f"{cursor.order}{num_dims}Q", cursor.buffer, cursor.pos))
    cursor.pos += 8 * num_dims
    type_id = cursor.scalar("I", f"the type of tensor {name!r}")
    offset = cursor.scalar("Q", f"the data offset of tensor {name!r}")
    return name, dims, type_id, offset


def _tensor(cursor: _Cursor, data: np.memmap, info: tuple[str, list[int], int, int], data_start: int) -> GGUFTensor:
    """The tensor of one info, its data a view of `data` (the file's map), checked to lie inside the file."""
    name, dims, type_id, offset = info
    try:
        kind = GGMLQuantizationType(type_id)
        block_size, type_size = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise cursor.fail(f"tensor {name!r} has unknown ggml type id {type_id}") from None
    num_elements = math.prod(dims)
    num_bytes, start = num_elements * type_size // block_size, data_start + offset
    if start + num_bytes > cursor.size:
        raise GGUFError(f"{cursor.path} is truncated: tensor {name!r} needs bytes up to {start + num_bytes}, file has {cursor.size}")
    element_shape = tuple(reversed(dims))  # [outermost, ..., innermost]
    if kind in _ELEMENT_DTYPES:
        dtype, view_shape = np.dtype(cursor.order + _ELEMENT_DTYPES[kind]), element_shape
    else:
        try:
            dtype, view_shape = np.dtype(np.uint8), quant_shape_to_byte_shape(element_shape, kind)
        except (ValueError, IndexError):
            raise cursor.fail(f"tensor {name!r} of type {kind.name} has innermost dim {dims[0] if dims else 1}, "
                              f"not a multiple of its block size {block_size}") from None
    view = data[start : start + num_bytes].view(dtype).reshape(view_shape)
    return GGUFTensor(name, kind, np.array(dims, dtype=np.uint64), num_elements, num_bytes, start, view)


def _read_tensors(cursor: _Cursor, data: np.memmap, num_tensors: int, fields: dict) -> tuple[int, int, list[GGUFTensor]]:
    """(alignment, data start, tensors): the tensor infos, then the data section's start (aligned)."""
    infos = [_read_tensor_info(cursor) for _ in range(num_tensors)]
    alignment = _alignment(cursor, fields.get("general.alignment"))
    data_start = -(-cursor.pos // alignment) * alignment
    names = set()
    tensors = []
    for info in infos:
        if info[0] in names:
            raise cursor.fail(f"tensor {info[0]!r} appears twice")
        names.add(info[0])
        tensors.append(_tensor(cursor, data, info, data_start))
    return alignment, data_start, tensors


def _alignment(cursor: _Cursor, field: GGUFField | None) -> int:
    if field is None:
        return GGUF_DEFAULT_ALIGNMENT
    if field.types != [GGUFValueType.UINT32] or field.value == 0 or field.value & (field.value - 1):
        raise cursor.fail(f"general.alignment must be a UINT32 power of two, not {field.types[0].name} {field.value!r}")
    return field.value


def _map(path: Path) -> np.memmap:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFError(f"cannot read GGUF file {path}: {e.strerror}") from None
    if magic != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (magic bytes {magic!r}, expected {MAGIC!r})")
    return np.memmap(path, dtype=np.uint8, mode="r")


def _header(cursor: _Cursor) -> int:
    """The version, after the magic; sets the cursor's byte order (a version with zero low bytes was
    written big-endian, as gguf-py decides)."""
    cursor.pos = 4
    version = cursor.scalar("I", "the version")
    if version & 0xFFFF == 0:
        cursor.order, cursor.pos = ">", 4
        version = cursor.scalar("I", "the version")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"{cursor.path} is GGUF version {version}; this reader reads versions {SUPPORTED_VERSIONS}")
    return version


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the GGUF file at `path`. Tensor data stays in the file's memory map.

    Raises:
      GGUFError: the file cannot be read, is not GGUF, is of another version, or is damaged or truncated.
    """
    path = Path(path)
    data = _map(path)
    cursor = _Cursor(data._mmap, data.size, path, "<")  # parse through the mmap object: struct and slices, no numpy views
    version = _header(cursor)
    num_tensors = cursor.count(_MIN_TENSOR_INFO_BYTES, "tensor infos")
    num_kv = cursor.count(_MIN_KV_BYTES, "key/value pairs")
    fields = {
        "GGUF.version": GGUFField("GGUF.version", [GGUFValueType.UINT32], version),
        "GGUF.tensor_count": GGUFField("GGUF.tensor_count", [GGUFValueType.UINT64], num_tensors),
        "GGUF.kv_count": GGUFField("GGUF.kv_count", [GGUFValueType.UINT64], num_kv),
    }
    _read_fields(cursor, num_kv, fields)
    alignment, data_start, tensors = _read_tensors(cursor, data, num_tensors, fields)
    return GGUFFile(path, data, version, cursor.order, alignment, data_start, fields, tensors)
