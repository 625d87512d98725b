"""The GGUF reader (jaxinfer.loading.gguf_reader) against gguf-py's GGUFReader, the independent reference: on
every GGUF at hand (llama.cpp's vocabularies in build/llama-cpp-python/models, the K-quant fixtures, the
embedded SmolLM2 model) and on files written here by gguf's GGUFWriter with every value type, both byte
orders, a custom alignment and tensors of float, integer and block types, it gives the same keys, types,
values and tensor infos, its tensor data views of the same map; a cut or damaged file is one error naming it.
"""

import math
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

import gguf_files
from conftest import FIXTURES
from jaxinfer.loading import gguf_reader
from jaxinfer.loading.model_files import ModelLoadError, default_model_path, open_gguf

VT = gguf.GGUFValueType


_BIG_FILE_BYTES = 2_000_000  # gguf-py needs ~1.5 s per MB of vocabulary (25 s on Gemma 4's): those run as slow tests
# Of the big vocabularies, Gemma 4's (the largest, 262k tokens) stands for the others: Qwen2 / Qwen3.5 / Llama-BPE's
# add no value type or layout it lacks, and comparing them would add about 30 s of gguf-py's parsing to make test.
_BIG_FILES_COMPARED = {"ggml-vocab-gemma-4.gguf"}


def _real_files() -> list:
    paths = sorted(gguf_files.llama_cpp_models().glob("*.gguf")) + sorted(FIXTURES.rglob("*.gguf")) + [default_model_path()]
    assert len(paths) >= 9, paths  # 6 vocabularies, 3 K-quant fixtures, SmolLM2
    big = lambda p: p.stat().st_size > _BIG_FILE_BYTES and p.parent != default_model_path().parent  # noqa: E731
    kept = [p for p in paths if not big(p) or p.name in _BIG_FILES_COMPARED]
    marks = lambda p: [pytest.mark.slow] if p.stat().st_size > _BIG_FILE_BYTES else []  # noqa: E731
    return [pytest.param(p, id=p.name, marks=marks(p)) for p in kept]


def _same(ours, theirs) -> bool:
    """Equal values of equal Python types; NaN equals NaN."""
    if isinstance(theirs, list):
        return isinstance(ours, list) and len(ours) == len(theirs) and all(_same(a, b) for a, b in zip(ours, theirs))
    if isinstance(theirs, float) and math.isnan(theirs):
        return isinstance(ours, float) and math.isnan(ours)
    return type(ours) is type(theirs) and ours == theirs


def _flat(value) -> list:
    """gguf-py flattens an array of arrays into one list."""
    return [x for v in value for x in _flat(v)] if isinstance(value, list) and value and isinstance(value[0], list) else value


def assert_same_as_gguf_py(path: Path) -> gguf_reader.GGUFFile:
    ours, theirs = gguf_reader.read_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        empty = field.types == [VT.ARRAY] and not field.data  # gguf-py leaves the element type of an empty array out
        assert mine.types == field.types or (empty and mine.types[0] == VT.ARRAY), (key, mine.types, field.types)
        assert _same(_flat(mine.contents()), field.contents()), f"{key}: values differ"
        if field.types[0] == VT.ARRAY and len(field.types) == 2:  # a flat array (gguf-py flattens nested ones)
            assert len(mine) == len(field.data), key
            assert _same(mine.contents(len(mine) // 2), field.contents(len(mine) // 2)) if len(mine) else True, key
    assert (ours.alignment, ours.data_offset, len(ours.tensors)) == (theirs.alignment, theirs.data_offset, len(theirs.tensors))
    for mine, tensor in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == \
            (tensor.name, tensor.tensor_type, tensor.n_elements, tensor.n_bytes, tensor.data_offset)
        assert mine.shape.tolist() == tensor.shape.tolist(), mine.name
        assert (mine.data.dtype, mine.data.shape) == (tensor.data.dtype, tensor.data.shape), mine.name
        assert np.array_equal(mine.data.view(np.uint8), tensor.data.view(np.uint8)), f"{mine.name}: data differ"
        assert np.shares_memory(mine.data, ours.data) and not mine.data.flags.owndata, f"{mine.name}: data copied out of the map"
    return ours


@pytest.mark.parametrize("path", _real_files())
def test_reader_equals_gguf_py_on_real_ggufs(path):
    ours = assert_same_as_gguf_py(path)
    assert ours.data._mmap is not None  # kept_blocks.release_pages drops tensor pages through this map


def _every_value_type(writer: gguf.GGUFWriter) -> None:
    for vtype, value in ((VT.UINT8, 255), (VT.INT8, -128), (VT.UINT16, 65535), (VT.INT16, -32768), (VT.UINT32, 2**32 - 1),
                         (VT.INT32, -(2**31)), (VT.FLOAT32, 0.1), (VT.BOOL, True), (VT.UINT64, 2**64 - 1), (VT.INT64, -(2**63)),
                         (VT.FLOAT64, 1e-300), (VT.STRING, "ünïcødé ✓")):
        writer.add_key_value(f"test.scalar.{vtype.name.lower()}", value, vtype)
        writer.add_key_value(f"test.array.{vtype.name.lower()}", [value, value, value] if vtype != VT.BOOL else [True, False, True], VT.ARRAY, sub_type=vtype)
    writer.add_key_value("test.array.float32_special", [float("nan"), float("inf"), -0.0, 1e-45], VT.ARRAY, sub_type=VT.FLOAT32)
    writer.add_array("test.array.nested", [[1, 2, 3], [4, 5], [6]])
    writer.add_array("test.array.nested_strings", [["a", "b"], ["c d"]])
    writer.add_array("test.array.strings", ["", " ", "a b", "\n", "🙂" * 40])


def _write_test_file(path: Path, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = None) -> dict[str, np.ndarray]:
    """A GGUF with every value type and six tensors; returns the tensors' values as written."""
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    if alignment:
        writer.add_custom_alignment(alignment)
    _every_value_type(writer)
    rng = np.random.default_rng(0)
    values = {"f32": rng.standard_normal((3, 5), np.float32), "f16": rng.standard_normal((4, 8)).astype(np.float16),
              "i32": rng.integers(-1000, 1000, (7,), dtype=np.int32), "q8_0": rng.standard_normal((2, 64), np.float32),
              "bf16": rng.standard_normal((2, 3, 32), np.float32), "q4_k": rng.integers(0, 256, (2, 2 * 144), dtype=np.uint8)}
    for name, value in values.items():
        if name == "q4_k":  # gguf cannot quantize to Q4_K: random blocks, as bytes
            writer.add_tensor(name, value, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        elif name in ("q8_0", "bf16"):
            kind = gguf.GGMLQuantizationType[name.upper()]
            writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, value)
    gguf_files.finish(writer)
    return values


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=["little", "big"])
@pytest.mark.parametrize("alignment", [None, 64, 4096])
def test_reader_equals_gguf_py_on_every_value_type_and_tensor_type(tmp_path, endianess, alignment):
    values = _write_test_file(tmp_path / "every.gguf", endianess, alignment)
    ours = assert_same_as_gguf_py(tmp_path / "every.gguf")
    assert ours.byte_order == ("<" if endianess == gguf.GGUFEndian.LITTLE else ">")
    assert ours.fields["test.array.nested"].contents() == [[1, 2, 3], [4, 5], [6]]
    assert ours.fields["test.scalar.string"].contents() == "ünïcødé ✓"
    assert ours.fields["test.array.strings"].contents() == ["", " ", "a b", "\n", "🙂" * 40]
    assert ours.fields["test.scalar.uint64"].contents() == 2**64 - 1 and ours.fields["test.scalar.float32"].contents() == float(np.float32(0.1))
    assert all(t.data_offset % (alignment or 32) == 0 for t in ours.tensors)
    tensors = {t.name: t for t in ours.tensors}
    for name in ("f32", "f16", "i32", "q4_k"):  # the values (or block bytes) written, back through the map
        assert np.array_equal(np.asarray(tensors[name].data), values[name]), name
    assert [tensors[name].shape.tolist() for name in values] == [[5, 3], [8, 4], [7], [64, 2], [32, 3, 2], [512, 2]]
    for name in ("q8_0", "bf16"):
        kind = gguf.GGMLQuantizationType[name.upper()]
        expected = gguf.quants.dequantize(gguf.quants.quantize(values[name], kind), kind)
        assert np.array_equal(gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type), expected), name


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key.encode())) + key.encode() + struct.pack("<I", vtype) + payload


def _gguf_bytes(*kvs: bytes, num_tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, num_tensors, len(kvs)) + b"".join(kvs)


def test_empty_arrays_read_like_gguf_py(tmp_path):
    """gguf's writer refuses empty arrays; llama.cpp's files may hold them."""
    (tmp_path / "empty.gguf").write_bytes(_gguf_bytes(
        _kv("empty.ints", VT.ARRAY, struct.pack("<IQ", VT.INT32, 0)), _kv("empty.strings", VT.ARRAY, struct.pack("<IQ", VT.STRING, 0)),
        _kv("after", VT.UINT8, b"\x07")))
    ours = assert_same_as_gguf_py(tmp_path / "empty.gguf")
    assert ours.fields["empty.strings"].types == [VT.ARRAY, VT.STRING] and ours.fields["empty.ints"].contents() == []
    assert ours.fields["after"].contents() == 7 and ours.tensors == []


def _cut_points(path: Path) -> dict[str, int]:
    """Byte offsets inside each part of a file written by _write_test_file."""
    data, ours = path.read_bytes(), gguf_reader.read_gguf(path)
    strings = data.index(b"test.array.strings") + len("test.array.strings") + 4 + 4 + 8
    tensor_infos = data.index(b"\x03\x00\x00\x00\x00\x00\x00\x00f32")
    return {"magic": 3, "version": 6, "counts": 20, "a key": 30, "a string array": strings + 12, "a tensor name": tensor_infos + 9,
            "the tensor infos' end": ours.data_offset - 40, "tensor data": ours.data_offset + 8, "the last byte": len(data) - 1}


@pytest.mark.parametrize("part", ["magic", "version", "counts", "a key", "a string array", "a tensor name", "the tensor infos' end", "tensor data", "the last byte"])
def test_a_cut_file_is_one_error_naming_it(tmp_path, part):
    _write_test_file(tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((tmp_path / "whole.gguf").read_bytes()[: _cut_points(tmp_path / "whole.gguf")[part]])
    with pytest.raises(ModelLoadError, match="not a GGUF file" if part == "magic" else "truncated") as caught:
        open_gguf(cut)
    assert str(cut) in str(caught.value)
    with pytest.raises(Exception):  # the reference refuses it too (with an error of its own)
        gguf.GGUFReader(cut)


@pytest.mark.parametrize("damage, message", [
    (lambda d: b"GGML" + d[4:], "not a GGUF file"),
    (lambda d: b"", "not a GGUF file"),
    (lambda d: d[:4] + struct.pack("<I", 1) + d[8:], "version 1"),
    (lambda d: d[:8] + b"\xff" * 16 + d[24:], "corrupt or truncated.*do not fit"),
    (lambda d: _gguf_bytes(_kv("k", 13, b"")), "unknown value type 13"),
    (lambda d: _gguf_bytes(_kv("k", VT.ARRAY, struct.pack("<IQ", VT.UINT32, 2**62))), "do not fit"),
    (lambda d: _gguf_bytes(_kv("k", VT.UINT8, b"\x01"), _kv("k", VT.UINT8, b"\x02")), "'k' appears twice"),
    (lambda d: _gguf_bytes(struct.pack("<Q", 1) + b"\xff" + struct.pack("<IB", VT.UINT8, 1)), "not UTF-8"),
    (lambda d: _gguf_bytes(_kv("general.alignment", VT.UINT32, struct.pack("<I", 48))), "power of two"),
    (lambda d: _gguf_bytes(num_tensors=1) + struct.pack("<Q", 1) + b"t" + struct.pack("<IQIQ", 1, 8, 99, 0) + b"\0" * 64, "unknown ggml type id 99"),
], ids=["magic", "empty", "version", "counts", "value-type", "array-count", "duplicate-key", "key-not-utf8", "alignment", "tensor-type"])
def test_a_damaged_file_is_one_error_naming_it(tmp_path, damage, message):
    _write_test_file(tmp_path / "whole.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage((tmp_path / "whole.gguf").read_bytes()))
    with pytest.raises(ModelLoadError, match=message) as caught:
        open_gguf(bad)
    assert str(bad) in str(caught.value)
