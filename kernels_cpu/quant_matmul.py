"""One layer's matmul on quantized weights, W8A8 in blocks of 32: a C++ XLA FFI kernel (quant_matmul.cc),
and the one jnp statement of the W8A8 arithmetic, which is both the kernel's reference and XLA's W8A8 path.

`quant_matmul(x, codes, scale, offset, layer)` computes `x @ w[layer]` for a weight kept as unsigned codes
with a per-(block of 32 inputs, column) scale and offset (w = code * scale + offset: GGUF Q8_0, Q4_0, Q4_1
and jaxinfer's int8 all have this form; jaxinfer's panels.py packs them), or, with `offset=None`, in the
symmetric form w = (code - zero_point) * scale (Q8_0 and int8: 128, Q4_0: 8), which skips a multiply-add
per block. Each block of 32 inputs of each row of x is quantized to int8 with the scale max|x| / 127
inside the kernel, and the block's dot is an exact int32 sum (AVX512-VNNI's u8 x s8 dot where the CPU
has it).

The rule in jnp: `quantize_activations` (the kernel's quantizer) and `block_dot` (exact int32 dots per
block, then the scales in f32). `reference` is them on the kernel's packed arrays and runs everywhere;
jaxinfer's quant._int8_dot (matmul_impl='int8') is them on a QuantizedTensor's stored int8 codes.
Axis letters: the table in kernels_cpu/__init__.py. Imports jax and numpy only.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Int8, UInt8

from kernels_cpu import build

SOURCE = "quant_matmul.cc"
TARGET = "jaxinfer_quant_matmul_cpu"  # with offsets
SYMMETRIC_TARGET = "jaxinfer_quant_matmul_symmetric_cpu"  # offset None: w = (code - zero_point) * scale
BLOCK = 32  # inputs per activation scale and per weight scale (kBlock): W8A8's one block size
PANEL = 16  # output columns per panel (kPanel); panels come in pairs (kPanels)


def available() -> bool:
    """Build (once per machine and source) and register the kernel; False, with a warning, if it cannot."""
    return build.load(SOURCE, ((TARGET, "JaxinferQuantMatmul"), (SYMMETRIC_TARGET, "JaxinferQuantMatmulSymmetric")))


def quant_matmul(
    x: Float[Array, "M I"], codes: UInt8[Array, "N C U 64"], scale: Float[Array, "N C A 16"], offset: Float[Array, "N C A 16"] | None,
    layer: Int[Array, ""], *, zero_point: int = 0,
) -> Float[Array, "M F"]:
    """`x @ w[layer]`, F = 16 C columns, reading layer `layer` of the stacks in place. U = I / 4 for 8-bit
    codes (byte 4c + i of row u: input 4u + i of column c), I / 8 for 4-bit (low nibbles inputs 8u..8u+3,
    high nibbles 8u+4..8u+7); scale and offset are float16, A = I / 32. `zero_point` is read only with
    `offset=None`."""
    if not available():
        raise RuntimeError("the CPU quantized-matmul kernel could not be built; see the warning above")
    result = jax.ShapeDtypeStruct((x.shape[0], codes.shape[1] * PANEL), jnp.float32)
    x, layer = x.astype(jnp.float32), jnp.asarray(layer, jnp.int32)
    if offset is None:
        return jax.ffi.ffi_call(SYMMETRIC_TARGET, result)(x, codes, scale, layer, zero_point=np.int32(zero_point))
    return jax.ffi.ffi_call(TARGET, result)(x, codes, scale, offset, layer)


def quantize_activations(x: Float[Array, "M I"], block: int = BLOCK) -> tuple[Int8[Array, "M A b"], Float[Array, "M A"]]:
    """x per block of `block` inputs as the kernel quantizes it (quantize_row in quant_matmul.cc): codes
    round(x * (127 / max|x|)) in [-127, 127], half to even, and the scale max|x| / 127 (0 for an all-zero
    block, whose codes are 0). A = I / block; W8A8 uses block = BLOCK."""
    blocks = x.astype(jnp.float32).reshape(x.shape[0], -1, block)  # [M, A, b]
    amax = jnp.max(jnp.abs(blocks), axis=-1)  # [M, A]
    inverse = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    codes = jnp.clip(jnp.round(blocks * inverse[..., None]), -127, 127).astype(jnp.int8)
    # The kernel's amax / 127.0f, correctly rounded: XLA rewrites a division by a constant or a broadcast scalar into
    # a product with its rounded reciprocal (one ulp off for some amax); a full divisor behind a barrier stays a division.
    return codes, amax / jax.lax.optimization_barrier(jnp.full(amax.shape, 127.0, jnp.float32))


def block_dot(
    x_codes: Int8[Array, "M A b"], x_scale: Float[Array, "M A"], codes: Int[Array, "F I"], scale: Float[Array, "F Z"],
    offset: Float[Array, "F Z"] | None = None,
) -> Float[Array, "F M"]:
    """W8A8 on quantized activations, [F, M]: out[f, m] = sum_a x_scale[m, a] * (scale[f, a] * sum_i
    codes[f, i] x_codes[m, a, i] + offset[f, a] * sum_i x_codes[m, a, i]), i over block a's inputs, each
    inner sum an exact int32.

    The weight is w[f, i] = codes[f, i] * scale[f, i // g] (+ offset[f, i // g]), g = I / Z a multiple of
    the activations' block b: Z = 1 (one scale per output column, applied once after the sum over blocks),
    Z = A, or anything between. Signed int8 codes meet the activations in an int8 x int8 -> int32 dot on
    the stored rows [F, A, b] (weight first: XLA:CPU's canonical left operand, no copy); other integer
    codes (the kernel's unsigned ones) in int32. Returns [F, M], the weight's orientation."""
    num_out, num_in = codes.shape
    num_blocks, block = x_codes.shape[1:]
    if codes.dtype != x_codes.dtype:  # unsigned codes: an exact int32 product
        codes, x_codes = codes.astype(jnp.int32), x_codes.astype(jnp.int32)
    rows = codes.reshape(num_out, num_blocks, block)  # [F, A, b]
    dots = jax.lax.dot_general(rows, x_codes, (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.int32).astype(jnp.float32)  # [A, F, M]
    scale = scale.astype(jnp.float32)
    if scale.shape[1] == 1 and offset is None:
        return jnp.einsum("afm,ma->fm", dots, x_scale) * scale
    per_block = lambda v: jnp.repeat(v.astype(jnp.float32), num_blocks // v.shape[1], axis=1)  # noqa: E731  [F, Z] -> [F, A]
    out = jnp.einsum("afm,fa,ma->fm", dots, per_block(scale), x_scale)
    if offset is None:
        return out
    sums = jnp.sum(x_codes, axis=-1, dtype=jnp.int32).astype(jnp.float32)  # [M, A]
    return out + jnp.einsum("fa,ma->fm", per_block(offset), x_scale * sums)


def unpack_codes(codes: UInt8[Array, "C U 64"], num_in: int) -> Int[Array, "I F"]:
    """One layer's packed codes -> the unsigned codes [I, 16 C] (input by column)."""
    num_panels = codes.shape[0]
    if codes.shape[1] == num_in // 4:  # 8-bit: [C, I/4, 16 columns, 4 inputs]
        values = codes.reshape(num_panels, num_in // 4, PANEL, 4).transpose(1, 3, 0, 2)
    else:  # 4-bit: [C, I/8, 16, 4], nibble h holds input 8u + 4h + i
        nibbles = jnp.stack([codes & 0x0F, codes >> 4], axis=2).reshape(num_panels, num_in // 8, 2, PANEL, 4)
        values = nibbles.transpose(1, 2, 4, 0, 3)
    return values.reshape(num_in, num_panels * PANEL).astype(jnp.int32)


def reference(
    x: Float[Array, "M I"], codes: UInt8[Array, "N C U 64"], scale: Float[Array, "N C A 16"], offset: Float[Array, "N C A 16"] | None,
    layer: Int[Array, ""], *, zero_point: int = 0,
) -> Float[Array, "M F"]:
    """`quant_matmul` in jnp: the same arguments, the same quantized activations, the same exact int32 block
    dots and the same scales (`block_dot`); only the order of the f32 sums over blocks differs."""
    if offset is None:
        offset = (-zero_point * scale.astype(jnp.float32)).astype(scale.dtype)  # exact: a power-of-two multiple
    num_in = x.shape[1]
    x_codes, x_scale = quantize_activations(x)  # [M, A, 32], [M, A]
    weight_codes = unpack_codes(codes[layer], num_in).T  # [F, I]
    per_column = lambda v: v[layer].astype(jnp.float32).transpose(0, 2, 1).reshape(weight_codes.shape[0], -1)  # noqa: E731  [C, A, 16] -> [F, A]
    return block_dot(x_codes, x_scale, weight_codes, per_column(scale), per_column(offset)).T  # [M, F]
