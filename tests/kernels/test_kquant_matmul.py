"""The CPU K-quant matmul kernel (kernels_cpu/kquant_matmul): Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 weights kept as
GGUF stores them, packed into panels (`pack`), times activations quantized in the kernel (int8 per 256 inputs for the K-quants, per 32 for q5_0 / q5_1).
Checked against a numpy int64 transcription of llama.cpp's block formats read straight from the blocks' bytes
(so `pack` and quant.from_gguf are checked too), against its jnp `reference`, against the float64 product with
`quant.dequantize` within the error W8A8 may add, and for the bytes it keeps. Blocks are random bytes as a file
holds them (every code and sub-scale value), with valid fp16 scales, and the tensors llama.cpp's own quantizer
wrote into tests/fixtures/kquant."""

import os
import pathlib

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from jaxinfer.model import quant
from kernels_cpu import kquant_matmul

pytestmark = pytest.mark.usefixtures("cpu_kernels", "kquant_kernel")


@pytest.fixture(scope="module")
def kquant_kernel() -> None:
    """This kernel built, as conftest.require_cpu_kernels asks of the others: skipped without a compiler, failed under CI=true."""
    if not kquant_matmul.available():
        reason = "the CPU K-quant kernel could not be built (no C++ compiler?)"
        pytest.fail(f"CI=true: {reason}", pytrace=False) if os.environ.get("CI", "").lower() == "true" else pytest.skip(reason)

TYPES = {"q4_k": QT.Q4_K, "q5_k": QT.Q5_K, "q6_k": QT.Q6_K, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1}
FP16_OFFSETS = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q5_0": (0,), "q5_1": (0, 2)}  # d (and dmin / m) in a block
pack_jit = jax.jit(kquant_matmul.pack, static_argnums=0)


def random_blocks(fmt: str, lead: int, rows: int, num_blocks: int, seed: int) -> np.ndarray:
    """uint8 [lead, rows, num_blocks * type size]: random bytes, fp16 scales ~N(0, 1e-2) (finite, some subnormal)."""
    rng = np.random.default_rng(seed)
    _, _, size = quant.GGUF_KEPT_TYPES[int(TYPES[fmt])]
    blocks = rng.integers(0, 256, (lead, rows, num_blocks, size), dtype=np.uint8)
    for offset in FP16_OFFSETS[fmt]:
        scale = rng.standard_normal((lead, rows, num_blocks)) * 1e-2
        scale[..., ::7] *= 1e-4
        blocks[..., offset : offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(lead, rows, num_blocks, 2)
    return blocks.reshape(lead, rows, -1)


def _fp16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view("<f2")[..., 0].astype(np.float64)


def _k_scale_min(packed: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's get_scale_min_k4 on the 12 scale bytes [..., 12]."""
    q = packed.astype(np.int64)
    if j < 4:
        return q[..., j] & 63, q[..., j + 4] & 63
    return (q[..., j + 4] & 0xF) | ((q[..., j - 4] >> 6) << 4), (q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4)


def _decode(fmt: str, blocks: np.ndarray):
    """One GGUF tensor's blocks [O, B, bytes], read as llama.cpp's dequantize_row_* reads them: signed integer
    codes [O, B, n], integer sub-block scales [O, B, S] (and mins), the fp16 d (and dmin or m) [O, B]."""
    if fmt in ("q5_0", "q5_1"):
        d = _fp16(blocks[..., 0:2])
        mins = _fp16(blocks[..., 2:4]) if fmt == "q5_1" else None
        start = 4 if fmt == "q5_1" else 2
        qh = blocks[..., start : start + 4].copy().view("<u4")[..., 0].astype(np.int64)  # [O, B]
        qs = blocks[..., start + 4 :].astype(np.int64)  # [O, B, 16]
        j = np.arange(16)
        x0 = (qs & 0xF) | (((qh[..., None] >> j) << 4) & 0x10)
        x1 = (qs >> 4) | ((qh[..., None] >> (j + 12)) & 0x10)
        codes = np.concatenate([x0, x1], axis=-1) - (16 if fmt == "q5_0" else 0)
        return codes, np.ones((*d.shape, 1), np.int64), None, d, mins
    if fmt == "q6_k":
        ql, qh = blocks[..., :128].astype(np.int64), blocks[..., 128:192].astype(np.int64)
        sc, d = blocks[..., 192:208].view(np.int8).astype(np.int64), _fp16(blocks[..., 208:210])
        codes = np.zeros((*blocks.shape[:-1], 256), np.int64)
        for n in range(2):  # halves of 128: ql += 64, qh += 32
            l_lo, l_hi, h = ql[..., 64 * n : 64 * n + 32], ql[..., 64 * n + 32 : 64 * n + 64], qh[..., 32 * n : 32 * n + 32]
            base = 128 * n
            codes[..., base : base + 32] = (l_lo & 0xF) | (((h >> 0) & 3) << 4)
            codes[..., base + 32 : base + 64] = (l_hi & 0xF) | (((h >> 2) & 3) << 4)
            codes[..., base + 64 : base + 96] = (l_lo >> 4) | (((h >> 4) & 3) << 4)
            codes[..., base + 96 : base + 128] = (l_hi >> 4) | (((h >> 6) & 3) << 4)
        return codes - 32, sc, None, d, None
    d, dmin, packed = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4]), blocks[..., 4:16]
    qh = blocks[..., 16:48].astype(np.int64) if fmt == "q5_k" else None
    qs = blocks[..., -128:].astype(np.int64)
    codes, scales, mins = [], [], []
    for pair in range(4):  # 64 elements: sub-blocks 2 pair (low nibbles) and 2 pair + 1 (high)
        q = qs[..., 32 * pair : 32 * pair + 32]
        for half, values in enumerate((q & 0xF, q >> 4)):
            if qh is not None:
                values = values + np.where(qh & (1 << (2 * pair + half)), 16, 0)
            sc, m = _k_scale_min(packed, 2 * pair + half)
            codes.append(values), scales.append(sc), mins.append(m)
    return np.concatenate(codes, axis=-1), np.stack(scales, -1), np.stack(mins, -1), d, dmin


def _quantized_x(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activation rule in numpy f32, one scale per `group` inputs: int64 codes [M, A, group],
    scales f64 [M, A]."""
    xb = x.reshape(x.shape[0], -1, group)
    amax = np.abs(xb).max(axis=-1)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.clip(np.round(xb * inverse[..., None]), -127, 127).astype(np.int64)
    return codes, (amax / np.float32(127)).astype(np.float64)


def numpy_kquant_w8a8(x: np.ndarray, fmt: str, blocks: np.ndarray) -> np.ndarray:
    """x [M, I] times one tensor's GGUF bytes [O, row bytes], by hand: exact int64 dots per sub-block of the
    signed codes with x's int8 codes, then the sub-block scales, mins and activation scales in float64."""
    _, block, size = quant.GGUF_KEPT_TYPES[int(TYPES[fmt])]
    codes, scales, mins, d, dmin = _decode(fmt, blocks.reshape(blocks.shape[0], -1, size))
    num_out, num_blocks = d.shape
    sub = block // scales.shape[-1]  # 16 (q6_k), else 32
    xq, sx = _quantized_x(x, block)  # [M, B, block], [M, B]: one activation scale per GGUF block
    xs = xq.reshape(x.shape[0], num_blocks, -1, sub)  # [M, B, S, sub]
    dots = np.einsum("obsk,mbsk->mobs", codes.reshape(num_out, num_blocks, -1, sub), xs).astype(np.float64)  # exact
    sx_sub = np.repeat(sx[..., None], xs.shape[2], axis=-1)  # [M, B, S]
    out = np.einsum("mobs,obs,ob,mbs->mo", dots, scales.astype(np.float64), d, sx_sub)
    if fmt == "q5_1":
        out += np.einsum("ob,mb->mo", dmin, sx_sub[..., 0] * xs.sum(axis=(-1, -2)))
    elif mins is not None:
        out -= np.einsum("obs,ob,mbs->mo", mins.astype(np.float64), dmin, sx_sub * xs.sum(-1))
    return out


def _packed(fmt: str, blocks: np.ndarray) -> tuple[quant.QuantizedTensor, dict]:
    q = quant.from_gguf(blocks, TYPES[fmt])
    return q, pack_jit(fmt, {name: jnp.asarray(a) for name, a in quant.array_fields(q).items()})


def _activations(rng, rows: int, num_in: int) -> np.ndarray:
    x = rng.standard_normal((rows, num_in)) * rng.uniform(0.1, 10, (rows, 1))
    x[:, 5] *= 30  # an outlier channel
    x[0, 32:64] = 0  # an all-zero block: scale 0
    x[-1, -256:] = 0  # an all-zero super-block: the K-quants' scale 0
    return x.astype(np.float32)


# I: K-quants 768 (3 super-blocks); q5_0 / q5_1 288 (9 blocks, not a whole 256)
ULPS = 8  # the f32 sums of 24 blocks against float64: about 2 ulps of the largest output seen
SHAPES = {"q4_k": 3, "q5_k": 3, "q6_k": 3, "q5_0": 9, "q5_1": 9}


@pytest.mark.parametrize("fmt", kquant_matmul.FORMATS)
def test_kernel_is_the_int64_transcription_of_the_blocks(fmt):
    """70 output columns (padded to 96: three column tiles), three layers, rows 1, 3 and 17 (the register
    tile is 4 rows: a remainder alone, and whole tiles plus one); the VNNI tiles and the plain loop."""
    blocks = random_blocks(fmt, 3, 70, SHAPES[fmt], seed=len(fmt) + ord(fmt[1]))
    q, packed = _packed(fmt, blocks)
    num_in = q.in_shape[0]
    rng = np.random.default_rng(1)
    for rows, layer in ((1, 2), (3, 0), (17, 1)):
        x = _activations(rng, rows, num_in)
        expected = numpy_kquant_w8a8(x, fmt, blocks[layer])
        scale = np.abs(expected).max()
        for vectorized in (True, False):
            ours = np.asarray(kquant_matmul.kquant_matmul(jnp.asarray(x), packed, jnp.int32(layer), fmt=fmt, num_in=num_in, vectorized=vectorized))
            assert ours.shape == (rows, 96)
            assert not ours[:, 70:].any()  # padding columns are zero weights
            err = np.abs(ours[:, :70] - expected).max() / scale
            assert err <= ULPS * np.finfo(np.float32).eps, (rows, vectorized, err)  # a few f32 roundings of the largest output


@pytest.mark.parametrize("fmt", kquant_matmul.FORMATS)
def test_reference_is_the_kernel_and_within_the_w8a8_bound_of_the_dense_product(fmt):
    """`reference` (jnp, same arithmetic) against the kernel; both against x @ dequantize(q) in float64, whose
    distance W8A8 bounds by sum_i |w_i| sx_i / 2 (each activation is off by at most half its block's step)."""
    blocks = random_blocks(fmt, 2, 64, SHAPES[fmt], seed=11)
    q, packed = _packed(fmt, blocks)
    num_in = q.in_shape[0]
    x = _activations(np.random.default_rng(2), 5, num_in)
    ours = np.asarray(kquant_matmul.kquant_matmul(jnp.asarray(x), packed, jnp.int32(1), fmt=fmt, num_in=num_in), np.float64)
    ref = np.asarray(kquant_matmul.reference(jnp.asarray(x), packed, jnp.int32(1), fmt=fmt, num_in=num_in), np.float64)
    assert np.abs(ours - ref).max() <= 2e-6 * np.abs(ref).max()
    dense = np.asarray(quant.dequantize(q), np.float64)[1]  # [O, I]
    exact = x.astype(np.float64) @ dense.T
    group = kquant_matmul.GROUP[fmt]
    _, sx = _quantized_x(x, group)
    bound = np.repeat(sx / 2, group, axis=1) @ np.abs(dense).T  # [M, O]
    error = np.abs(ours[:, :64] - exact)
    assert (error <= bound * 1.0001 + 1e-6 * np.abs(exact).max()).all()
    assert np.linalg.norm(ours[:, :64] - exact) / np.linalg.norm(exact) > 1e-5  # it really is W8A8, not f32


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_1"])
@pytest.mark.parametrize("rows", [4, 16, 18])
def test_runs_of_column_tiles_cover_every_column(fmt, rows):
    """288 columns: nine tiles; at up to 16 rows runs of four tiles prefetch the next tile's bytes (two runs
    of four and one of one), one tile a task above that; every column against the reference."""
    blocks = random_blocks(fmt, 1, 288, 1 if fmt != "q5_1" else 8, seed=rows)
    q, packed = _packed(fmt, blocks)
    num_in = q.in_shape[0]
    x = jnp.asarray(_activations(np.random.default_rng(rows), rows, num_in))
    ours = np.asarray(kquant_matmul.kquant_matmul(x, packed, jnp.int32(0), fmt=fmt, num_in=num_in))
    ref = np.asarray(kquant_matmul.reference(x, packed, jnp.int32(0), fmt=fmt, num_in=num_in))
    per_column = np.abs(ours - ref).max(axis=0) / np.abs(ref).max()
    assert per_column.max() <= 2e-6, np.flatnonzero(per_column > 2e-6)


@pytest.mark.parametrize("fmt", kquant_matmul.FORMATS)
def test_packed_bytes_stay_within_three_percent_of_the_files(fmt):
    """A stack of 2 layers of 64 x 512 (whole column tiles): the panels keep every bit in at most 1.03 x the
    GGUF bytes (the K-quants' 12 bytes of 6-bit scales become 16), and unpack to the stored codes."""
    blocks = random_blocks(fmt, 2, 64, 512 // quant.GGUF_KEPT_TYPES[int(TYPES[fmt])][1], seed=3)
    q, packed = _packed(fmt, blocks)
    assert sorted(packed) == sorted(kquant_matmul.PANEL_FIELDS[fmt])
    assert all(a.shape[:2] == (2, 4) for a in packed.values())  # [N, C, ...]
    assert sum(a.nbytes for a in packed.values()) <= 1.03 * blocks.nbytes
    codes = kquant_matmul.stored_codes(fmt, {name: jnp.asarray(a) for name, a in quant.array_fields(q).items()})
    unpacked = kquant_matmul.unpack_codes(fmt, {name: a[1] for name, a in packed.items()}, 512)
    np.testing.assert_array_equal(np.asarray(unpacked), np.asarray(codes[1], np.int32))


def test_bad_layer_and_unknown_format_are_errors_naming_them():
    _, packed = _packed("q4_k", random_blocks("q4_k", 2, 32, 1, seed=0))
    x = jnp.ones((1, 256), jnp.float32)
    with pytest.raises(Exception, match="layer out of range"):
        np.asarray(kquant_matmul.kquant_matmul(x, packed, jnp.int32(2), fmt="q4_k", num_in=256))
    with pytest.raises(ValueError, match="q3_k"):
        kquant_matmul.pack("q3_k", {})
    with pytest.raises(Exception, match="high must be"):  # q5_k reads 8 rows of high bits per 256 inputs
        np.asarray(kquant_matmul.kquant_matmul(x, {**packed, "high": jnp.zeros((2, 2, 4, 64), jnp.uint8)}, jnp.int32(0), fmt="q5_k", num_in=256))


def test_no_rows_give_an_empty_result():
    _, packed = _packed("q6_k", random_blocks("q6_k", 1, 32, 1, seed=0))
    out = kquant_matmul.kquant_matmul(jnp.zeros((0, 256), jnp.float32), packed, jnp.int32(0), fmt="q6_k", num_in=256)
    assert out.shape == (0, 32)


KQUANT_FILES = pathlib.Path(__file__).parents[1] / "fixtures" / "kquant"  # llama.cpp's quantizer wrote them


@pytest.mark.parametrize("name", ["q4_k_m", "q5_k_m", "q6_k"])
def test_llama_cpp_quantized_tensors_multiply_as_their_bytes_say(name):
    """Blocks written by llama.cpp's own quantizer (tests/reference/make_kquant_files.py): one tensor of each
    K-quant type in the file through pack and the kernel, against the int64 transcription of its bytes."""
    reader = gguf.GGUFReader(KQUANT_FILES / f"{name}.gguf")
    first = {}
    for tensor in reader.tensors:
        fmt = tensor.tensor_type.name.lower()
        if fmt in kquant_matmul.FORMATS and fmt not in first:
            first[fmt] = tensor
    assert set(first) >= {name[:4]}, sorted(first)
    rng = np.random.default_rng(5)
    for fmt, tensor in first.items():
        blocks = np.asarray(tensor.data)[None]  # [1, O, row bytes]
        _, packed = _packed(fmt, blocks)
        num_in = int(tensor.shape[0])
        x = _activations(rng, 3, num_in)
        ours = np.asarray(kquant_matmul.kquant_matmul(jnp.asarray(x), packed, jnp.int32(0), fmt=fmt, num_in=num_in))
        expected = numpy_kquant_w8a8(x, fmt, blocks[0])
        assert np.abs(ours[:, : blocks.shape[1]] - expected).max() <= ULPS * np.finfo(np.float32).eps * np.abs(expected).max(), fmt


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_0"])
def test_activation_ties_round_to_even_as_numpy_does(fmt):
    """Activations whose codes fall exactly halfway (max|x| = 127 makes x * 127 / max|x| = x): the kernel's
    vector quantization rounds them to even, as np.round in the transcription does; one code off would move an
    output by about a weight, far above the f32 tolerance."""
    blocks = random_blocks(fmt, 1, 32, SHAPES[fmt], seed=21)
    q, packed = _packed(fmt, blocks)
    num_in = q.in_shape[0]
    halves = np.arange(num_in, dtype=np.float32) % 254 - 126.5  # -126.5 .. 126.5 in steps of 1: every code a tie
    x = np.stack([halves, -halves[::-1]])
    x[:, :: kquant_matmul.GROUP[fmt]] = 127.0  # each group's max |x| is 127: the scale is exactly 1
    expected = numpy_kquant_w8a8(x, fmt, blocks[0])
    for vectorized in (True, False):
        ours = np.asarray(kquant_matmul.kquant_matmul(jnp.asarray(x), packed, jnp.int32(0), fmt=fmt, num_in=num_in, vectorized=vectorized))
        assert np.abs(ours - expected).max() <= ULPS * np.finfo(np.float32).eps * np.abs(expected).max(), vectorized


def saturated_blocks(fmt: str, seed: int, q6_scale: int = 127) -> np.ndarray:
    """u8[1, 32, 2 blocks]: random blocks whose every byte but the fp16 scales saturates (all bits set: codes and
    6-bit sub-scales at their largest); q6_k's int8 sub-scales set to `q6_scale`."""
    blocks = random_blocks(fmt, 1, 32, 2, seed=seed)
    size = quant.GGUF_KEPT_TYPES[int(TYPES[fmt])][2]
    per_block = blocks.reshape(1, 32, 2, size)
    keep = np.zeros(size, bool)  # the fp16 scales stay random; every other byte saturates
    for offset in FP16_OFFSETS[fmt]:
        keep[offset : offset + 2] = True
    per_block[..., ~keep] = 0xFF
    if fmt == "q6_k":
        per_block[..., 192:208] = np.uint8(q6_scale & 0xFF)
    return per_block.reshape(1, 32, -1)


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
def test_largest_codes_and_scales_against_full_scale_activations_stay_exact(fmt):
    """Every code and sub-scale at its largest (all bits set; q6_k's int8 scales 127) times activations all at
    +-127: the integer dots of a sub-block reach their bound (q4_k: 15 * 127 * 32 = 60960, past an int16, so a
    kernel folding them through 16-bit multiplies would wrap; random blocks never come near), and rows of mixed
    signs cancel them. Four rows: one register tile of four, and the plain loop."""
    blocks = saturated_blocks(fmt, seed=4)
    q, packed = _packed(fmt, blocks)
    num_in = q.in_shape[0]
    ones = np.ones(num_in, np.float32)
    x = np.stack([ones, -ones, np.where(np.arange(num_in) % 32 < 16, ones, -ones), np.where(np.arange(num_in) % 2 == 0, 3 * ones, -ones)])
    expected = numpy_kquant_w8a8(x, fmt, blocks[0])
    for vectorized in (True, False):
        ours = np.asarray(kquant_matmul.kquant_matmul(jnp.asarray(x), packed, jnp.int32(0), fmt=fmt, num_in=num_in, vectorized=vectorized))
        assert np.abs(ours - expected).max() <= ULPS * np.finfo(np.float32).eps * np.abs(expected).max(), vectorized
