"""One layer's matmul on quantized weights, W8A8 in blocks of 32: a C++ XLA FFI kernel (quant_matmul.cc).

`quant_matmul(x, codes, scale, offset, layer)` computes `x @ w[layer]` for a weight kept as unsigned codes
with a per-(block of 32 inputs, column) scale and offset (w = code * scale + offset: GGUF Q8_0, Q4_0, Q4_1
and jaxinfer's int8 all have this form; panels.py packs them), or, with `offset=None`, in the symmetric form
w = (code - zero_point) * scale (Q8_0 and int8: 128, Q4_0: 8), which skips a multiply-add per block. Each block of 32 inputs of each row of x
is quantized to int8 with the scale max|x| / 127 inside the kernel, and the block's dot is an exact int32
sum (AVX512-VNNI's u8 x s8 dot where the CPU has it). `reference` is the same arithmetic in jnp on the same
packed arrays; it runs everywhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt8

from kernels_cpu import build

SOURCE = "quant_matmul.cc"
TARGET = "jaxinfer_quant_matmul_cpu"  # with offsets
SYMMETRIC_TARGET = "jaxinfer_quant_matmul_symmetric_cpu"  # offset None: w = (code - zero_point) * scale
BLOCK = 32  # inputs per activation scale and per weight scale (kBlock)
PANEL = 16  # output columns per panel (kPanel); panels come in pairs (kPanels)


def available() -> bool:
    """Build (once per machine and source) and register the kernel; False, with a warning, if it cannot."""
    return build.load(SOURCE, ((TARGET, "JaxinferQuantMatmul"), (SYMMETRIC_TARGET, "JaxinferQuantMatmulSymmetric")))


def quant_matmul(
    x: Float[Array, "M K"], codes: UInt8[Array, "N P S 64"], scale: Float[Array, "N P B 16"], offset: Float[Array, "N P B 16"] | None,
    layer: Int[Array, ""], *, zero_point: int = 0,
) -> Float[Array, "M F"]:
    """`x @ w[layer]`, F = 16 P columns, reading layer `layer` of the stacks in place. S = K / 4 for 8-bit
    codes (byte 4c + i of row s: input 4s + i of column c), K / 8 for 4-bit (low nibbles inputs 8s..8s+3,
    high nibbles 8s+4..8s+7); scale and offset are float16, B = K / 32. `zero_point` is read only with
    `offset=None`."""
    if not available():
        raise RuntimeError("the CPU quantized-matmul kernel could not be built; see the warning above")
    result = jax.ShapeDtypeStruct((x.shape[0], codes.shape[1] * PANEL), jnp.float32)
    x, layer = x.astype(jnp.float32), jnp.asarray(layer, jnp.int32)
    if offset is None:
        return jax.ffi.ffi_call(SYMMETRIC_TARGET, result)(x, codes, scale, layer, zero_point=np.int32(zero_point))
    return jax.ffi.ffi_call(TARGET, result)(x, codes, scale, offset, layer)


def quantize_activations(x: Float[Array, "M K"]) -> tuple[Int[Array, "M B 32"], Float[Array, "M B"]]:
    """x per block of 32 as the kernel quantizes it: codes round(x * 127 / max|x|) in [-127, 127], scale max|x| / 127."""
    blocks = x.astype(jnp.float32).reshape(x.shape[0], -1, BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    inverse = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    codes = jnp.clip(jnp.round(blocks * inverse[..., None]), -127, 127).astype(jnp.int32)
    return codes, amax / 127.0


def unpack_codes(codes: UInt8[Array, "P S 64"], num_in: int) -> Int[Array, "K F"]:
    """One layer's packed codes -> the unsigned codes [K, 16 P] (input by column)."""
    num_panels = codes.shape[0]
    if codes.shape[1] == num_in // 4:  # 8-bit: [P, K/4, 16 columns, 4 inputs]
        values = codes.reshape(num_panels, num_in // 4, PANEL, 4).transpose(1, 3, 0, 2)
    else:  # 4-bit: [P, K/8, 16, 4], nibble h holds input 8s + 4h + i
        nibbles = jnp.stack([codes & 0x0F, codes >> 4], axis=2).reshape(num_panels, num_in // 8, 2, PANEL, 4)
        values = nibbles.transpose(1, 2, 4, 0, 3)
    return values.reshape(num_in, num_panels * PANEL).astype(jnp.int32)


def reference(
    x: Float[Array, "M K"], codes: UInt8[Array, "N P S 64"], scale: Float[Array, "N P B 16"], offset: Float[Array, "N P B 16"] | None,
    layer: Int[Array, ""], *, zero_point: int = 0,
) -> Float[Array, "M F"]:
    """`quant_matmul` in jnp: the same quantized activations, the same exact int32 block dots, the same
    scales; only the order of the f32 sums over blocks differs."""
    if offset is None:
        offset = (-zero_point * scale.astype(jnp.float32)).astype(scale.dtype)  # exact: a power-of-two multiple
    num_in = x.shape[1]
    q, sx = quantize_activations(x)  # [M, B, 32], [M, B]
    u = unpack_codes(codes[layer], num_in).reshape(num_in // BLOCK, BLOCK, -1)  # [B, 32, F]
    dots = jnp.einsum("mbk,bkf->mbf", q, u, preferred_element_type=jnp.int32).astype(jnp.float32)
    w_scale = scale[layer].astype(jnp.float32).transpose(1, 0, 2).reshape(num_in // BLOCK, -1)  # [B, F]
    w_offset = offset[layer].astype(jnp.float32).transpose(1, 0, 2).reshape(num_in // BLOCK, -1)
    sums = jnp.sum(q, axis=-1).astype(jnp.float32)  # [M, B]
    return jnp.einsum("mbf,bf,mb->mf", dots, w_scale, sx) + jnp.einsum("bf,mb->mf", w_offset, sx * sums)
