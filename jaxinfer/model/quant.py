"""Quantized weights that stay quantized on the device: the one owner of quantized weight formats.

Owns `QuantizedTensor` (a pytree: integer codes and per-group scales as arrays, the format and the
logical shape as static metadata), the host converters into it (GGUF blocks kept as they are, and the
int8 / int4 quantizers), `dequantize` in plain jnp, the quant-aware matmul `qeinsum` / lookup `take`, and
device-byte accounting (`resident_bytes`). Imports jax, numpy and kernels_cpu.quant_matmul (the one
W8A8 rule: its activation quantizer and block dot), not gguf, not the rest of jaxinfer. The CPU kernels'
panel layout lives in panels.py, the KV pool's per-token codes in kv_pool.py.

Orientation. Every matrix is stored as GGUF and Hugging Face store it: rows are output channels (O),
and the groups that share a scale run along the input (contraction) axis I. Every array field is
`[*lead, O, per_row]`, row-major, so `lax.scan` over a stacked leading layer axis slices it like any
weight, and `permute_out` / `stack` work on every field alike. The *logical* shape, what `dequantize`
returns, is static metadata: `layout="in_out"` gives `[*lead, *in_shape, *out_shape]` (the Params layout
of model.py: wq [D, H, K], wo [H, K, D], w_down [F, D]); `layout="out_in"` gives `[*lead, *out_shape,
*in_shape]` (the embedding [V, D], whose rows `take` gathers).

Numerics. `dequantize` of a kept GGUF tensor is bit-identical to `gguf.quants.dequantize` on every
backend, FMA contraction or not (f16 / bf16: a cast, exact in f32): scales are fp16 (11 significant bits), sub-block scales <= 7 bits and
codes <= 6 bits, so every product is exact in f32 (<= 24 bits); only the final add of a minimum rounds,
once, in either order of evaluation. Dequantization is elementwise + broadcast + reshape (no gather, no
dynamic slice), so XLA may fuse it into the consuming dot.
"""

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, UInt8

from jaxinfer.config import INT4_GROUP_SIZES
from kernels_cpu import quant_matmul

# ggml type id -> (format name, elements per block, bytes per block); the ids are llama.cpp's (stable).
GGUF_KEPT_TYPES = {
    8: ("q8_0", 32, 34),
    2: ("q4_0", 32, 18),
    3: ("q4_1", 32, 20),
    6: ("q5_0", 32, 22),
    7: ("q5_1", 32, 24),
    12: ("q4_k", 256, 144),
    13: ("q5_k", 256, 176),
    14: ("q6_k", 256, 210),
    1: ("f16", 1, 2),  # 16-bit floats kept as stored: no scales, dequantize is an exact cast
    30: ("bf16", 1, 2),
}
FLOAT16_FORMATS = {"f16": np.dtype("<f2"), "bf16": np.dtype(jnp.bfloat16)}  # format -> its codes' dtype
_BITS = {"f16": 16, "bf16": 16, "q8_0": 8, "q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5, "q4_k": 4, "q5_k": 5, "q6_k": 6, "int8": 8, "int4": 4}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizedTensor:
    """A quantized matrix (or a stack of them). B = blocks per row; the byte layouts are tabled above `_dequantize_q8_0`.

    Array fields, all `[*lead, O, per_row]`:
      codes: the integer codes (uint8 nibble planes for 4/5/6-bit formats; int8 for q8_0 and int8), or
        the values themselves for f16 / bf16 (float16 / bfloat16 [.., O, I], a GGUF F16 / BF16 tensor as stored).
      scales: None for f16 / bf16; else one per group: fp16 [.., O, B] (GGUF 32-blocks), bf16 [.., O, I/g] (int4), f32 [.., O, 1]
        (int8), or the integer sub-block scales of K-quants: uint8 [.., O, 8B] (q4_k/q5_k), int8 [.., O, 16B].
      mins: per-group minimums: fp16 [.., O, B] (q4_1, q5_1) or uint8 sub-block mins [.., O, 8B] (K-quants).
      zero_points: uint8 [.., O, I/g], int4 with a zero point only.
      high_bits: the bit plane above the low nibble: 5-bit formats (1 bit) and q6_k (2 bits).
      super_scales, super_mins: fp16 [.., O, B], the K-quants' per-256 `d` and `dmin`.
    """

    codes: Array
    scales: Array | None = None  # None only for f16 / bf16
    mins: Array | None = None
    zero_points: Array | None = None
    high_bits: Array | None = None
    super_scales: Array | None = None
    super_mins: Array | None = None
    format: str = dataclasses.field(metadata=dict(static=True))  # a key of _BITS
    group_size: int = dataclasses.field(metadata=dict(static=True))  # input elements sharing one scale
    in_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # logical input axes (I = prod)
    out_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # logical output axes (O = prod)
    layout: Literal["in_out", "out_in"] = dataclasses.field(default="out_in", metadata=dict(static=True))
    # How qeinsum multiplies it: "float" (dequantized to the activations' dtype first) or "int8" (int8 and
    # q8_0 only: W8A8, the activations quantized per block and XLA's int8 x int8 -> int32 dot; `_int8_dot`).
    activations: Literal["float", "int8"] = dataclasses.field(default="float", metadata=dict(static=True))

    def __post_init__(self):  # metadata only: array fields may be tracers or placeholders here
        if self.format not in _BITS:
            raise ValueError(f"unknown quantized format {self.format!r}; known: {', '.join(_BITS)}")
        if self.activations not in ("float", "int8") or (self.activations == "int8" and self.format not in _INT8_CODE_FORMATS):
            raise ValueError(f"activations={self.activations!r}: 'int8' activations need int8 codes (int8 or q8_0), got {self.format!r}")
        if self.layout not in ("in_out", "out_in"):
            raise ValueError(f"{self.layout=} must be 'in_out' or 'out_in'")

    @property
    def bits(self) -> int:
        return _BITS[self.format]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape `dequantize` returns, leading (stacking) axes included."""
        lead = tuple(self.codes.shape[:-2])
        return lead + (self.in_shape + self.out_shape if self.layout == "in_out" else self.out_shape + self.in_shape)


def array_fields(q: QuantizedTensor) -> dict[str, object]:
    """The array fields that are present, by name (every one is `[*lead, O, per_row]`)."""
    names = ("codes", "scales", "mins", "zero_points", "high_bits", "super_scales", "super_mins")
    return {name: getattr(q, name) for name in names if getattr(q, name) is not None}


# ---------------------------------------------------------------- dequantization (jnp, device)


def _f32(x) -> Array:
    return jnp.asarray(x).astype(jnp.float32)


def _blocks(field, *trailing: int) -> Array:
    """[*lead, O, B * prod(trailing)] -> [*lead, O, B, *trailing] (a bitcast in row-major)."""
    field = jnp.asarray(field)
    return field.reshape(*field.shape[:-1], -1, *trailing)


def _nibbles(packed: Array) -> Array:
    """uint8 [..., n] -> [..., 2n]: element j is the low nibble of byte j, element n + j its high nibble."""
    shifts = jnp.asarray(np.array([0, 4], np.uint8))[:, None]  # [2, 1]
    return ((packed[..., None, :] >> shifts) & 0x0F).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _bit_fields(packed: Array, width: int) -> Array:
    """uint8 [..., n] -> [..., 8 // width, n]: field s of byte e is bits [s * width, (s + 1) * width)."""
    shifts = jnp.asarray(np.arange(0, 8, width, dtype=np.uint8))[:, None]  # [8 / width, 1]
    return (packed[..., None, :] >> shifts) & ((1 << width) - 1)


# Kept layouts, per row of O (B blocks along I; "nib" = a uint8 nibble plane, byte j holds element j in its
# low nibble and element n + j in its high nibble, n = bytes in the plane; bytes/row vs the file's):
#   q8_0  codes int8 32B                 scales f16 B                                    34B (= file)
#   q4_0  codes nib 16B                  scales f16 B                                    18B (= file)
#   q4_1  codes nib 16B                  scales f16 B, mins f16 B                        20B (= file)
#   q5_0  codes nib 16B, high_bits 4B    scales f16 B            (bit j of LE u32 = element j) 22B (= file)
#   q5_1  codes nib 16B, high_bits 4B    scales f16 B, mins f16 B                        24B (= file)
#   q4_k  codes 4 x nib 32 per 256       scales u8 8B, mins u8 8B, super_* f16 B         148B (file 144)
#   q5_k  as q4_k + high_bits 32B        (bit s of byte e = sub-block s, element e)      180B (file 176)
#   q6_k  codes 2 x nib 64, high_bits 2 x 32 (2-bit fields), scales i8 16B, super f16 B  210B (= file)
#   int8  codes int8 I                   scales f32 1 (per output channel)
#   int4  codes nib g/2 per group        scales bf16 I/g [, zero_points u8 I/g]
# K-quants unpack their 12 bytes of 6-bit sub-scales on the host (the only growth: 4 bytes per 256).


def _dequantize_q8_0(q):  # codes int8 [.., O, 32B]; scales f16 [.., O, B]
    return _f32(_blocks(q.codes, 32)) * _f32(q.scales)[..., None]


def _dequantize_q4_0(q):  # codes: per 32-block 16 bytes, element j low nibble of byte j, j + 16 high
    codes = (_nibbles(_blocks(q.codes, 16)).astype(jnp.int8) - 8).astype(jnp.float32)  # [.., O, B, 32]
    return _f32(q.scales)[..., None] * codes


def _dequantize_q4_1(q):  # as q4_0, unsigned codes; + per-block fp16 min
    codes = _f32(_nibbles(_blocks(q.codes, 16)))
    return _f32(q.scales)[..., None] * codes + _f32(q.mins)[..., None]


def _five_bit_codes(q) -> Array:
    """Q5_0/Q5_1 codes [.., O, B, 32]: low nibbles as q4_0; high_bits 4 bytes per block, the
    little-endian uint32 whose bit j is element j's fifth bit."""
    shifts = jnp.asarray(np.arange(8, dtype=np.uint8))  # [8]
    high = (_blocks(q.high_bits, 4)[..., None] >> shifts) & 1  # [.., O, B, 4, 8]: bit s of byte e
    return _nibbles(_blocks(q.codes, 16)) | (high.reshape(*high.shape[:-2], 32) << 4)  # element 8e + s


def _dequantize_q5_0(q):
    codes = (_five_bit_codes(q).astype(jnp.int8) - 16).astype(jnp.float32)
    return _f32(q.scales)[..., None] * codes


def _dequantize_q5_1(q):
    return _f32(q.scales)[..., None] * _f32(_five_bit_codes(q)) + _f32(q.mins)[..., None]


def _k_scales_and_mins(q) -> tuple[Array, Array]:
    """Per-32 sub-block scale d * sc and min dmin * m [.., O, B, 8, 1]; both products exact in f32."""
    scale = _f32(q.super_scales)[..., None] * _f32(_blocks(q.scales, 8))
    minimum = _f32(q.super_mins)[..., None] * _f32(_blocks(q.mins, 8))
    return scale[..., None], minimum[..., None]


def _dequantize_q4_k(q):  # codes: per 256-block 4 x 32 bytes; 32 bytes hold sub-blocks 2i (low) and 2i + 1
    codes = _f32(_nibbles(_blocks(q.codes, 4, 32))).reshape(*q.codes.shape[:-1], -1, 8, 32)
    scale, minimum = _k_scales_and_mins(q)
    return (scale * codes - minimum).reshape(*codes.shape[:-2], 256)


def _dequantize_q5_k(q):  # low nibbles as q4_k; high_bits 32 bytes per block: bit s of byte e -> sub-block s
    low = _nibbles(_blocks(q.codes, 4, 32)).reshape(*q.codes.shape[:-1], -1, 8, 32)
    codes = _f32(low | (_bit_fields(_blocks(q.high_bits, 32), 1) << 4))  # [.., O, B, 8, 32]
    scale, minimum = _k_scales_and_mins(q)
    return (scale * codes - minimum).reshape(*codes.shape[:-2], 256)


def _dequantize_q6_k(q):
    """codes 2 x 64 bytes per 256-block (element 128h + 64k + b: nibble k of byte 64h + b); high_bits 2 x 32
    bytes (element 128h + 32s + e: bits 2s..2s+1 of byte 32h + e); scales int8 per 16 elements."""
    low = _nibbles(_blocks(q.codes, 2, 64))  # [.., O, B, 2, 128]
    high = _bit_fields(_blocks(q.high_bits, 2, 32), 2)  # [.., O, B, 2, 4, 32]
    codes = (low | (high.reshape(low.shape) << 4)).astype(jnp.int8) - 32
    codes = codes.reshape(*low.shape[:-2], 16, 16).astype(jnp.float32)  # [.., O, B, 16, 16]
    scale = _f32(q.super_scales)[..., None] * _f32(_blocks(q.scales, 16))  # [.., O, B, 16]
    return (scale[..., None] * codes).reshape(*codes.shape[:-2], 256)


def _dequantize_int8(q):  # codes int8 [.., O, I]; scales f32 [.., O, 1]: one group per row
    return _f32(q.codes)[..., None, :] * _f32(q.scales)[..., None]


def _dequantize_int4(q):  # codes: per group g/2 bytes, nibble layout of q4_0; bf16 scales, uint8 zero points
    codes = _f32(_nibbles(_blocks(q.codes, q.group_size // 2)))  # [.., O, I/g, g]
    zero = 8.0 if q.zero_points is None else _f32(q.zero_points)[..., None]
    return (codes - zero) * _f32(q.scales)[..., None]


def _dequantize_float16(q):  # codes float16 / bfloat16 [.., O, I]: f32 holds every 16-bit float exactly
    return _f32(q.codes)


_DEQUANTIZERS = {
    "f16": _dequantize_float16, "bf16": _dequantize_float16, "q8_0": _dequantize_q8_0, "q4_0": _dequantize_q4_0, "q4_1": _dequantize_q4_1,
    "q5_0": _dequantize_q5_0, "q5_1": _dequantize_q5_1, "q4_k": _dequantize_q4_k,
    "q5_k": _dequantize_q5_k, "q6_k": _dequantize_q6_k, "int8": _dequantize_int8, "int4": _dequantize_int4,
}


def _dequantize_rows(q: QuantizedTensor) -> Float[Array, "*lead O I"]:
    values = _DEQUANTIZERS[q.format](q)  # [*lead, O, B, block]
    return values.reshape(*q.codes.shape[:-1], math.prod(q.in_shape))


def _dequantize_stored(q: QuantizedTensor) -> Float[Array, "..."]:
    """[*lead, *out_shape, *in_shape]: the storage orientation, no transpose."""
    return _dequantize_rows(q).reshape(*q.codes.shape[:-2], *q.out_shape, *q.in_shape)


def dequantize(q: QuantizedTensor, dtype=jnp.float32) -> Float[Array, "..."]:
    """The dense weight in its logical shape `q.shape`, computed in f32 then cast to `dtype`.

    For kept GGUF formats the f32 values equal `gguf.quants.dequantize` bit for bit (module docstring).
    """
    values = _dequantize_stored(q)  # [*lead, *out_shape, *in_shape]
    if q.layout == "in_out":
        lead, num_out = q.codes.ndim - 2, len(q.out_shape)
        order = (*range(lead), *range(lead + num_out, values.ndim), *range(lead, lead + num_out))
        values = jnp.transpose(values, order)  # [*lead, *in_shape, *out_shape]
    return values.astype(dtype)


def qeinsum(spec: str, x: Float[Array, "..."], w: Float[Array, "..."] | QuantizedTensor, *, preferred_element_type=None) -> Float[Array, "..."]:
    """`jnp.einsum(spec, x, w)` where `w` is a dense array or a QuantizedTensor in its logical layout.

    A quantized `w` is dequantized in jnp to `x.dtype` in its storage orientation and the spec's `w`
    subscripts are reordered to match, so the dot consumes the dequantization directly (no transpose),
    which XLA may fuse into it. `spec` must be explicit ("x_subs,w_subs->out", no ellipsis).
    """
    if not isinstance(w, QuantizedTensor):
        return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    inputs, arrow, output = spec.replace(" ", "").partition("->")
    x_subs, _, w_subs = inputs.partition(",")
    num_lead = w.codes.ndim - 2
    if not arrow or "." in w_subs or len(w_subs) != len(w.shape):
        raise ValueError(f"qeinsum needs an explicit spec with one letter per axis of w {w.shape}; got {spec!r}")
    lead_subs, logical = w_subs[:num_lead], w_subs[num_lead:]
    if w.layout == "in_out":
        logical = logical[len(w.in_shape):] + logical[: len(w.in_shape)]  # -> out letters, then in letters
    if w.activations == "int8":
        if lead_subs:
            raise ValueError(f"int8 activations multiply one matrix, not a stack {w.shape}; spec {spec!r}")
        return _int8_dot(w, logical, x, x_subs, output).astype(preferred_element_type or x.dtype)
    dense = _dequantize_stored(w).astype(x.dtype)  # [*lead, *out_shape, *in_shape]
    if lead_subs:
        return jnp.einsum(f"{x_subs},{lead_subs}{logical}->{output}", x, dense, preferred_element_type=preferred_element_type)
    return _weight_first_dot(dense, logical, x, x_subs, output, preferred_element_type)


def _weight_first_dot(dense, w_subs: str, x, x_subs: str, output: str, preferred_element_type):
    """`einsum(x_subs,w_subs->output)` as a dot_general with the weight [*out, *in] as its first operand.

    [O, I] row-major is XLA:CPU's canonical [M, K], so the dequantization fusion writes the weight in
    the order it reads the codes. With the weight second (jnp.einsum's order, or einsum with swapped
    operands, which XLA swaps back) XLA:CPU wants [I, O], and the fusion transposes every layer's weight
    on the way: int8 decode at batch 1 ran 2-3x slower (measured, /tmp microbenchmarks, 2026-12-01)."""
    contracted = [c for c in w_subs if c in x_subs and c not in output]
    dims = ((tuple(w_subs.index(c) for c in contracted), tuple(x_subs.index(c) for c in contracted)), ((), ()))
    y = jax.lax.dot_general(dense, x, dims, preferred_element_type=preferred_element_type)
    y_subs = "".join(c for c in w_subs if c not in contracted) + "".join(c for c in x_subs if c not in contracted)
    return jnp.transpose(y, tuple(y_subs.index(c) for c in output))


INT8_PARTIAL_BYTES = 64 * 2**20  # above this, W8A8's per-block int32 sums are not materialized (_int8_dot)
_INT8_CODE_FORMATS = ("int8", "q8_0")  # formats whose codes are plain int8 with per-row or per-block scales


def _int8_dot(w: QuantizedTensor, w_subs: str, x, x_subs: str, output: str) -> Float[Array, "..."]:
    """W8A8, llama.cpp's Q8_0 x Q8_0 arithmetic, by the one rule of kernels_cpu/quant_matmul (which the CPU
    kernel runs too): each block of quant_matmul.BLOCK = 32 entries of each token of `x` is quantized to
    int8 with the symmetric scale max|x| / 127 (`quant_matmul.quantize_activations`); XLA's integer dot
    multiplies it with the weight's stored int8 codes into an exact int32 per (block, output, token), and
    both scales are applied in f32 (`quant_matmul.block_dot`). Per-token scales (one block of I) cost
    SmolLM2 +3.5% perplexity, blocks of 32 +0.69% (64: +0.65%; the probe of commit 2d2d0b2): a few outlier
    channels no longer set every other channel's step. q8_0 codes are read as stored, so the dot is exact
    on a GGUF Q8_0 tensor's blocks; the int8 format's per-row scale applies after the sum.

    XLA has no fused block dot: the sums are an [I/32, O, R] array. Where it would pass INT8_PARTIAL_BYTES
    (a long prefill chunk of a 1B model: gigabytes), the same quantized activations are multiplied in f32
    with the dequantized weight instead: the same values up to f32 rounding, at the float path's speed."""
    contracted = [c for c in w_subs if c in x_subs and c not in output]
    rest = [c for c in x_subs if c not in contracted]
    num_in, num_out = math.prod(w.in_shape), math.prod(w.out_shape)
    block = math.gcd(num_in, quant_matmul.BLOCK, w.group_size)
    xt = jnp.transpose(x.astype(jnp.float32), [x_subs.index(c) for c in rest + contracted])
    rest_shape = xt.shape[: len(rest)]
    x_codes, x_scale = quant_matmul.quantize_activations(xt.reshape(-1, num_in), block)  # [R, I/b, b], [R, I/b]
    if 4 * num_out * x_codes.shape[0] * (num_in // block) > INT8_PARTIAL_BYTES:
        dequantized_x = (x_codes.astype(jnp.float32) * x_scale[..., None]).reshape(-1, num_in)  # [R, I]
        y = jax.lax.dot_general(_dequantize_rows(w).reshape(num_out, num_in), dequantized_x, (((1,), (1,)), ((), ())))  # [O, R]
        return _to_output(y, w, contracted, rest, rest_shape, w_subs, output)
    codes = w.codes.reshape(num_out, num_in)  # [O, I]: the stored rows, no copy
    y = quant_matmul.block_dot(x_codes, x_scale, codes, w.scales.reshape(num_out, -1))  # [O, R]; scales [O, 1] (int8) or [O, I/32] (q8_0)
    return _to_output(y, w, contracted, rest, rest_shape, w_subs, output)


def _to_output(y: Float[Array, "O R"], w: QuantizedTensor, contracted, rest, rest_shape, w_subs: str, output: str) -> Float[Array, "..."]:
    """[O, R] -> the einsum's output order."""
    y_subs = "".join(c for c in w_subs if c not in contracted) + "".join(rest)
    y = y.reshape(*w.out_shape, *rest_shape)
    return jnp.transpose(y, tuple(y_subs.index(c) for c in output))


def with_int8_activations(tree):
    """`tree` with every QuantizedTensor of int8 codes (int8, q8_0) multiplied W8A8 (activations="int8");
    the rest unchanged."""
    def convert(leaf):
        return dataclasses.replace(leaf, activations="int8") if isinstance(leaf, QuantizedTensor) and leaf.format in _INT8_CODE_FORMATS else leaf

    return jax.tree_util.tree_map(convert, tree, is_leaf=lambda leaf: isinstance(leaf, QuantizedTensor))


def has_int8_weights(tree) -> bool:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda leaf: isinstance(leaf, QuantizedTensor))
    return any(isinstance(leaf, QuantizedTensor) and leaf.format in _INT8_CODE_FORMATS for leaf in leaves)


AFFINE_FORMATS = ("q8_0", "q4_0", "q4_1", "int8")  # formats with one scale and offset per block of 32 (affine_blocks)
_ZERO_POINTS = {"q8_0": 128, "int8": 128, "q4_0": 8}  # the symmetric ones: offset = -zero_point * scale


def affine_zero_point(fmt: str) -> int | None:
    """The unsigned code of 0 in a symmetric affine format (q8_0 and int8: 128, q4_0: 8), whose offset is
    -zero_point * scale; None for q4_1, whose offsets are its own minimums."""
    return _ZERO_POINTS.get(fmt)


def affine_blocks(q: QuantizedTensor) -> tuple[UInt8[Array, "*lead O I"], Float[Array, "*lead O B"], Float[Array, "*lead O B"]]:
    """q as unsigned codes u with a scale and an offset per block of 32 inputs: w = u * scale + offset, B = I / 32.

    q8_0 and int8 shift their codes by 128 (offset = -128 scale), q4_0 keeps its nibbles (offset = -8 scale),
    q4_1 its nibbles and minimums (affine_zero_point). u * scale + offset is the dequantized value exactly for
    the GGUF formats (fp16 scales: every term fits f32) and up to one f32 rounding for int8. The
    kernels_cpu/quant_matmul panels hold scale and offset in float16, which is exact for the GGUF formats
    (their scales are float16 and the offsets power-of-two multiples of them) and rounds the int8 format's f32
    per-row scale."""
    if q.format not in AFFINE_FORMATS or math.prod(q.in_shape) % 32:
        raise ValueError(f"affine_blocks takes {', '.join(AFFINE_FORMATS)} with inputs in blocks of 32, got {q.format!r} {q.shape}")
    lead_rows, num_in = q.codes.shape[:-1], math.prod(q.in_shape)
    zero_point = affine_zero_point(q.format)
    if q.format in ("q8_0", "int8"):
        codes = (q.codes.astype(jnp.int16) + zero_point).astype(jnp.uint8)
        scale = _f32(q.scales) if q.format == "q8_0" else jnp.broadcast_to(_f32(q.scales), (*lead_rows, num_in // 32))
        return codes, scale, -float(zero_point) * scale
    codes = _nibbles(_blocks(q.codes, 16)).reshape(*lead_rows, num_in)
    scale = _f32(q.scales)
    return codes, scale, (_f32(q.mins) if zero_point is None else -float(zero_point) * scale)


def take(w: Float[Array, "O ..."] | QuantizedTensor, indices: Int[Array, "..."], dtype=jnp.float32) -> Float[Array, "..."]:
    """Rows `w[indices]` ([*indices.shape, *in_shape]); a quantized `w` gathers codes, then dequantizes
    only those rows. Quantized `w` must be `out_in` with one output axis and no leading axes."""
    if not isinstance(w, QuantizedTensor):
        return jnp.asarray(w)[indices]
    if w.layout != "out_in" or len(w.out_shape) != 1 or w.codes.ndim != 2:
        raise ValueError(f"take needs an unstacked out_in matrix; got {w.layout=}, {w.out_shape=}, {w.codes.shape=}")
    flat = jnp.reshape(indices, (-1,))
    rows = {name: jnp.take(jnp.asarray(field), flat, axis=0, mode="clip") for name, field in array_fields(w).items()}
    picked = dataclasses.replace(w, **rows, out_shape=(flat.shape[0],))
    return _dequantize_rows(picked).reshape(*jnp.shape(indices), *w.in_shape).astype(dtype)


# ---------------------------------------------------------------- GGUF blocks -> kept form (host, numpy)


def _split_bytes(blocks: np.ndarray, *sizes: int) -> list[np.ndarray]:
    """Consecutive byte ranges of every block, each contiguous [*lead, O, B, size]."""
    offsets = np.cumsum((0,) + sizes)
    assert offsets[-1] == blocks.shape[-1], (sizes, blocks.shape)
    return [np.ascontiguousarray(blocks[..., start:stop]) for start, stop in zip(offsets[:-1], offsets[1:])]


def _fp16(raw: np.ndarray) -> np.ndarray:
    """[.., B, 2] little-endian bytes -> float16 [.., B] (the bits as they are)."""
    return raw.view("<f2")[..., 0]


def _row_major(part: np.ndarray) -> np.ndarray:
    """[*lead, O, B, k] -> [*lead, O, B * k]."""
    return part.reshape(*part.shape[:-2], -1)


def _k_sub_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of 6-bit Q4_K/Q5_K sub-block scales and mins -> uint8 [.., B, 8] each.
    Bytes 0-3: scale j (low 6 bits), top 2 bits of scale j + 4; bytes 4-7: the same for mins;
    bytes 8-11: low nibble = scale j + 4 (low 4 bits), high nibble = min j + 4 (low 4 bits)."""
    low_scale, low_min, nibbles = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low_scale & 0x3F, (nibbles & 0x0F) | ((low_scale >> 6) << 4)], axis=-1)
    mins = np.concatenate([low_min & 0x3F, (nibbles >> 4) | ((low_min >> 6) << 4)], axis=-1)
    return scales, mins


def _fields_from_blocks(name: str, blocks: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 [*lead, O, B, bytes per block] -> the array fields of QuantizedTensor, numpy."""
    if name in FLOAT16_FORMATS:  # [*lead, O, I, 2] -> [*lead, O, I]: a view of the file's bytes, no copy
        return dict(codes=blocks.view(FLOAT16_FORMATS[name])[..., 0])
    if name == "q8_0":
        d, codes = _split_bytes(blocks, 2, 32)
        return dict(codes=_row_major(codes.view(np.int8)), scales=_fp16(d))
    if name in ("q4_0", "q4_1", "q5_0", "q5_1"):
        sizes = {"q4_0": (2, 0, 0, 16), "q4_1": (2, 2, 0, 16), "q5_0": (2, 0, 4, 16), "q5_1": (2, 2, 4, 16)}[name]
        d, m, qh, qs = _split_bytes(blocks, *sizes)
        fields = dict(codes=_row_major(qs), scales=_fp16(d))
        fields.update({"mins": _fp16(m)} if m.shape[-1] else {})
        fields.update({"high_bits": _row_major(qh)} if qh.shape[-1] else {})
        return fields
    if name in ("q4_k", "q5_k"):
        d, dmin, packed, qh, qs = _split_bytes(blocks, 2, 2, 12, 32 if name == "q5_k" else 0, 128)
        scales, mins = _k_sub_scales(packed)
        fields = dict(codes=_row_major(qs), scales=_row_major(scales), mins=_row_major(mins), super_scales=_fp16(d), super_mins=_fp16(dmin))
        fields.update({"high_bits": _row_major(qh)} if name == "q5_k" else {})
        return fields
    ql, qh, scales, d = _split_bytes(blocks, 128, 64, 16, 2)  # q6_k
    return dict(codes=_row_major(ql), high_bits=_row_major(qh), scales=_row_major(scales.view(np.int8)), super_scales=_fp16(d))


def _logical_axes(out_dim: int, in_dim: int, out_shape, in_shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    out_shape = tuple(int(n) for n in (out_shape or (out_dim,)))
    in_shape = tuple(int(n) for n in (in_shape or (in_dim,)))
    if math.prod(out_shape) != out_dim or math.prod(in_shape) != in_dim:
        raise ValueError(f"{out_shape=} / {in_shape=} do not factor the [{out_dim}, {in_dim}] matrix")
    return out_shape, in_shape


def from_gguf(
    data: UInt8[np.ndarray, "*lead O row_bytes"],
    gguf_type: int,
    *,
    out_shape: tuple[int, ...] | None = None,
    in_shape: tuple[int, ...] | None = None,
    layout: Literal["in_out", "out_in"] = "out_in",
) -> QuantizedTensor:
    """Keep a GGUF tensor's blocks (as `GGUFReader` gives them: `tensor.data`, `tensor.tensor_type`).

    Host only and lossless: bytes are split into codes and fp16 scales, the K-quants' 6-bit sub-block
    scales unpacked to uint8; F16 / BF16 values become the codes of "f16" / "bf16", a view of `data`
    (uint8 bytes, or float16 as GGUFReader gives F16). Returns numpy leaves; `jax.device_put` the result (or a `stack` of them).

    Args:
      data: uint8 [*lead, O, row_bytes], rows of blocks along the input axis.
      gguf_type: one of GGUF_KEPT_TYPES (a `GGMLQuantizationType` works).
      out_shape, in_shape: the logical factoring of O and I (default (O,) and (I,)).
      layout: "in_out" for Params-layout weights, "out_in" for the embedding.
    """
    if int(gguf_type) not in GGUF_KEPT_TYPES:
        kept = ", ".join(name.upper() for name, _, _ in GGUF_KEPT_TYPES.values())
        raise ValueError(f"GGUF type {gguf_type!r} is not a kept quantized format (kept: {kept})")
    name, block_size, type_size = GGUF_KEPT_TYPES[int(gguf_type)]
    data = np.asarray(data)
    if name in FLOAT16_FORMATS and data.dtype == np.float16:  # GGUFReader gives F16 as values, BF16 as bytes
        data = data.view(np.uint8)
    if data.dtype != np.uint8 or data.ndim < 2 or data.shape[-1] % type_size:
        raise ValueError(f"{name}: expected uint8 [.., O, k * {type_size}] blocks, got {data.dtype} {data.shape}")
    blocks = data.reshape(*data.shape[:-1], data.shape[-1] // type_size, type_size)  # [*lead, O, B, bytes]
    out_shape, in_shape = _logical_axes(data.shape[-2], blocks.shape[-2] * block_size, out_shape, in_shape)
    group_size = {"q6_k": 16, "f16": 1, "bf16": 1}.get(name, 32)
    return QuantizedTensor(**_fields_from_blocks(name, blocks), format=name, group_size=group_size, in_shape=in_shape, out_shape=out_shape, layout=layout)


# ---------------------------------------------------------------- int8 / int4 quantizers (jnp)


@functools.partial(jax.jit, static_argnames=("out_shape", "in_shape", "layout"))
def quantize_int8(
    w: Float[ArrayLike, "*lead O I"], *, out_shape=None, in_shape=None, layout: Literal["in_out", "out_in"] = "out_in"
) -> QuantizedTensor:
    """Symmetric int8, one f32 scale per output channel (row): scale = max|w| / 127, codes in [-127, 127].

    Round to nearest, so |w - dequantize| <= scale / 2 up to f32 rounding. `w` is [*lead, O, I] in any
    float dtype (f32, bf16, f16 convert exactly); the other arguments are as in `from_gguf`.
    """
    w = _f32(w)  # [*lead, O, I]
    scale = jnp.max(jnp.abs(w), axis=-1, keepdims=True) / 127  # [*lead, O, 1]
    divisor = jnp.where(scale == 0, 1.0, scale)  # an all-zero row keeps scale 0 and codes 0
    codes = jnp.clip(jnp.round(w / divisor), -127, 127).astype(jnp.int8)
    out_shape, in_shape = _logical_axes(w.shape[-2], w.shape[-1], out_shape, in_shape)
    return QuantizedTensor(codes=codes, scales=scale, format="int8", group_size=w.shape[-1], in_shape=in_shape, out_shape=out_shape, layout=layout)


def _bf16_at_least(x: Float[Array, "..."]) -> Array:
    """The smallest bfloat16 >= x, for x >= 0 finite: round to nearest, then one step up if it fell below."""
    nearest = x.astype(jnp.bfloat16)
    up = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(nearest, jnp.uint16) + 1, jnp.bfloat16)
    return jnp.where(nearest.astype(jnp.float32) < x, up, nearest)


@functools.partial(jax.jit, static_argnames=("group_size", "symmetric", "out_shape", "in_shape", "layout"))
def quantize_int4(
    w: Float[ArrayLike, "*lead O I"], *, group_size: int = 32, symmetric: bool = True,
    out_shape=None, in_shape=None, layout: Literal["in_out", "out_in"] = "out_in",
) -> QuantizedTensor:
    """Group-wise int4 along the input axis, two codes per byte, one bf16 scale per group.

    Symmetric: scale >= max|w| / 7, value = (code - 8) * scale with code in [1, 15]. With a zero point:
    the group's range is widened to include 0, scale >= (max - min) / 15, zero point z = round(-min /
    scale) in [0, 15] (uint8), value = (code - z) * scale. Scales round *up* to bf16 and codes are computed
    from the stored scale, so every element is within scale / 2 of its dequantized value (up to f32 rounding).
    """
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{group_size=} must be one of {INT4_GROUP_SIZES}")
    w = _f32(w)
    if w.shape[-1] % group_size:
        raise ValueError(f"input dim {w.shape[-1]} is not a multiple of {group_size=}")
    groups = w.reshape(*w.shape[:-1], -1, group_size)  # [*lead, O, I/g, g]
    if symmetric:
        scale = _bf16_at_least(jnp.max(jnp.abs(groups), axis=-1) / 7)  # [*lead, O, I/g]
        zero = jnp.full(scale.shape, 8.0, jnp.float32)
    else:
        low, high = jnp.minimum(groups.min(axis=-1), 0.0), jnp.maximum(groups.max(axis=-1), 0.0)
        scale = _bf16_at_least((high - low) / 15)
    divisor = jnp.where(scale == 0, 1.0, scale.astype(jnp.float32))[..., None]
    if not symmetric:
        zero = jnp.clip(jnp.round(-low / divisor[..., 0]), 0, 15)
    codes = jnp.clip(jnp.round(groups / divisor) + zero[..., None], 0, 15).astype(jnp.uint8)  # [.., I/g, g]
    half = group_size // 2
    packed = codes[..., :half] | (codes[..., half:] << 4)  # byte j: element j low, element j + g/2 high
    out_shape, in_shape = _logical_axes(w.shape[-2], w.shape[-1], out_shape, in_shape)
    return QuantizedTensor(
        codes=packed.reshape(*w.shape[:-1], -1), scales=scale, zero_points=None if symmetric else zero.astype(jnp.uint8),
        format="int4", group_size=group_size, in_shape=in_shape, out_shape=out_shape, layout=layout,
    )


# ---------------------------------------------------------------- host helpers and accounting


def permute_out(q: QuantizedTensor, order: Int[np.ndarray, "O"]) -> QuantizedTensor:
    """Reorder the output channels (rows) of every field: row i of the result is row order[i]."""
    return dataclasses.replace(q, **{name: np.take(np.asarray(field), order, axis=-2) for name, field in array_fields(q).items()})


def stack(tensors: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack same-format tensors on a new leading axis (host numpy), as Params stacks layers for scan."""
    return jax.tree.map(lambda *fields: np.stack([np.asarray(f) for f in fields]), *tensors)


def resident_bytes(tree) -> int:
    """Bytes the backend really allocated for the jax.Array leaves of `tree` (each buffer counted once).

    Uses each shard's `on_device_size_in_bytes()`, not `nbytes`: e.g. jnp.int4 reports nbytes of one byte
    per element but the CPU backend holds two per byte. Host numpy leaves are an error: not on a device.
    """
    total, seen = 0, set()
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, np.ndarray):
            raise TypeError(f"a host numpy leaf {leaf.dtype}{list(leaf.shape)} holds no device memory; device_put the tree first")
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            key = (shard.device.id, shard.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                total += shard.data.on_device_size_in_bytes()
    return total
