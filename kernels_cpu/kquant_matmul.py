"""One layer's matmul on GGUF K-quant (and Q5_0 / Q5_1) weights kept exactly as stored: a C++ XLA FFI kernel
(kquant_matmul.cc), its panel packing `pack` and the jnp statement of the same arithmetic, `reference`.

The weights stay in their two-level scales: no scale is multiplied out and rounded. Activations are int8,
symmetric, one scale sx = max|x| / 127 per group of a row (quant_matmul.quantize_activations): per 256 inputs
for the K-quants (llama.cpp's Q8_K granularity: the sub-block scales then fold into integer sums, and the float
work is once per 256), per 32 for q5_0 / q5_1 (the project's W8A8 rule). Per group, with dot_j the exact int32
dot of the unsigned weight codes q of sub-block j with the activation codes and sum_j the sum of those codes:

  q4_k, q5_k  w = d sc_j q - dmin m_j (sub-block j of 32, 6-bit sc_j and m_j, fp16 d and dmin per 256):
              per 256: f32(sum_j sc_j dot_j) (sx d) - f32(sum_j m_j sum_j) (sx dmin)
  q6_k        w = d sc_h (q - 32) (sub-block h of 16, int8 sc_h, fp16 d per 256):
              per 256: f32(sum_h sc_h dot_h - 32 sum_h sc_h sum_h) (sx d)
  q5_0        w = d (q - 16) per 32: sx (dot - 16 sum) d
  q5_1        w = d q + m per 32: sx (dot d + sum m)
The integer sums are exact in int32. A sum of terms in f32 per column; only its order differs between the
kernel and `reference`.

Panel layout (`pack`): every array is [*lead, C, ..., 16] with C panels of 16 output columns (the output
padded to whole column tiles of 32), each panel contiguous per array:
  codes         u8  [*lead, C, I/8, 64]   low 4 bits of the codes, quant_matmul's 4-bit layout: row u holds
                                          inputs 8u..8u+3 in the low nibbles (byte 4c + i: input 8u + i of
                                          column c) and 8u+4..8u+7 in the high ones
  high          u8  [*lead, C, I/32, 64]  5-bit formats: bit 4 of the codes; byte 4c + i of row g, bit 2k + h:
                                          input 32g + 8k + 4h + i (k = code row within the 32, h = nibble)
                u8  [*lead, C, I/16, 64]  q6_k: bits 4-5; byte 4c + i of row g, bits 4k + 2h .. + 1:
                                          input 16g + 8k + 4h + i
  scales        u8  [*lead, C, I/32, 16]  q4_k / q5_k sc_j; int8 [*lead, C, I/16, 16] q6_k sc_h;
                f16 [*lead, C, I/32, 16]  q5_0 / q5_1 d
  mins          u8  [*lead, C, I/32, 16]  q4_k / q5_k m_j; f16 [*lead, C, I/32, 16] q5_1 m
  super_scales  f16 [*lead, C, I/256, 16] K-quants' d
  super_mins    f16 [*lead, C, I/256, 16] q4_k / q5_k dmin
Bytes per 256 inputs and column: q4_k 148 (file 144), q5_k 180 (176), q6_k 210 (210), q5_0 176 (176), q5_1 192
(192), before the column padding. Axis letters: the table in kernels_cpu/__init__.py. Imports jax and numpy only.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kernels_cpu import build
from kernels_cpu.quant_matmul import quantize_activations

SOURCE = "kquant_matmul.cc"
TARGET = "jaxinfer_kquant_matmul_cpu"
FORMATS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1")
FORMAT_IDS = {fmt: i for i, fmt in enumerate(FORMATS)}  # the kernel's `format` attribute
PANEL = 16  # output columns per panel
TILE = 32  # output columns per column tile (two panels): the output is padded to whole tiles
BLOCK = 32  # inputs per block of q5_0 / q5_1
SUPER = {"q4_k": 256, "q5_k": 256, "q6_k": 256, "q5_0": 32, "q5_1": 32}  # inputs per GGUF block
GROUP = SUPER  # inputs per activation scale: one per GGUF block (llama.cpp's Q8_K granularity for the K-quants)
HIGH_BITS = {"q4_k": 0, "q5_k": 1, "q6_k": 2, "q5_0": 1, "q5_1": 1}  # bits above the low nibble
ZERO_POINT = {"q6_k": 32, "q5_0": 16}  # code of 0 in the symmetric formats
PANEL_FIELDS = {  # the arrays `pack` returns, in the kernel's argument order
    "q4_k": ("codes", "scales", "mins", "super_scales", "super_mins"),
    "q5_k": ("codes", "high", "scales", "mins", "super_scales", "super_mins"),
    "q6_k": ("codes", "high", "scales", "super_scales"),
    "q5_0": ("codes", "high", "scales"),
    "q5_1": ("codes", "high", "scales", "mins"),
}
_ARGS = ("codes", "high", "scales", "mins", "super_scales", "super_mins")  # the kernel's buffers (absent: empty)


def available() -> bool:
    """Build (once per machine and source) and register the kernel; False, with a warning, if it cannot."""
    return build.load(SOURCE, ((TARGET, "JaxinferKquantMatmul"),))


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"kquant_matmul reads {', '.join(FORMATS)}; got format {fmt!r}")


# ---------------------------------------------------------------- stored fields -> integer codes (jnp)


def _nibbles(packed: Array) -> Array:
    """uint8 [..., n] -> [..., 2n]: element j is the low nibble of byte j, element n + j its high nibble."""
    return jnp.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _bit_planes(packed: Array, width: int) -> Array:
    """uint8 [..., n] -> [..., 8 // width, n]: field s of byte e is bits [s * width, (s + 1) * width)."""
    shifts = jnp.arange(0, 8, width, dtype=jnp.uint8)[:, None]
    return (packed[..., None, :] >> shifts) & ((1 << width) - 1)


def stored_codes(fmt: str, fields: dict[str, Array]) -> Array:
    """The unsigned codes q [*lead, O, I] (uint8) of a QuantizedTensor's fields, as GGUF orders them."""
    _check_format(fmt)
    codes = jnp.asarray(fields["codes"])
    lead_rows = codes.shape[:-1]
    if fmt in ("q5_0", "q5_1"):  # per 32: 16 nibble bytes; 4 high bytes, bit j of the LE u32 = element j
        low = _nibbles(codes.reshape(*lead_rows, -1, 16))  # [.., B, 32]
        high = _bit_planes(jnp.asarray(fields["high_bits"]).reshape(*lead_rows, -1, 4), 1)  # [.., B, 8, 4]: bit s of byte e
        return (low | (jnp.swapaxes(high, -1, -2).reshape(low.shape) << 4)).reshape(*lead_rows, -1)
    if fmt in ("q4_k", "q5_k"):  # per 256: 4 x 32 bytes, sub-blocks 2i (low nibbles) and 2i + 1
        low = _nibbles(codes.reshape(*lead_rows, -1, 4, 32)).reshape(*lead_rows, -1, 8, 32)
        if fmt == "q5_k":  # 32 high bytes: bit s of byte e -> element e of sub-block s
            low = low | (_bit_planes(jnp.asarray(fields["high_bits"]).reshape(*lead_rows, -1, 32), 1) << 4)
        return low.reshape(*lead_rows, -1)
    low = _nibbles(codes.reshape(*lead_rows, -1, 2, 64))  # q6_k: [.., B, 2, 128]
    high = _bit_planes(jnp.asarray(fields["high_bits"]).reshape(*lead_rows, -1, 2, 32), 2)  # [.., B, 2, 4, 32]
    return (low | (high.reshape(low.shape) << 4)).reshape(*lead_rows, -1)


# ---------------------------------------------------------------- packing into panels (jnp)


def _column_panels(a: Array, num_out: int) -> Array:
    """[*lead, O, J] -> [*lead, C, J, 16], O zero-padded to whole tiles."""
    lead = a.shape[:-2]
    padded = -(-num_out // TILE) * TILE
    a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, padded - num_out), (0, 0)])
    return jnp.swapaxes(a.reshape(*lead, padded // PANEL, PANEL, a.shape[-1]), -2, -1)


def _quads(codes: Array, num_out: int) -> Array:
    """[*lead, O, I] -> [*lead, C, I/4, 16, 4]: input quads by column."""
    lead, num_in = codes.shape[:-2], codes.shape[-1]
    panels = _column_panels(codes, num_out)  # [*lead, C, I, 16]
    return jnp.swapaxes(panels.reshape(*panels.shape[:-2], num_in // 4, 4, PANEL), -1, -2)


def _merge_fields(fields: Array, width: int) -> Array:
    """[*lead, C, R, 8 // width, 16, 4] -> u8 [*lead, C, R, 64]: field t at bits t * width."""
    merged = fields[..., 0, :, :]
    for t in range(1, 8 // width):  # in uint8: no wider temporary than the codes
        merged = merged | (fields[..., t, :, :] << (t * width))
    return merged.reshape(*merged.shape[:-2], 4 * PANEL)


def pack(fmt: str, fields: dict[str, Array]) -> dict[str, Array]:
    """The kernel's panel arrays (module docstring) of a QuantizedTensor's fields (quant.array_fields(q) of a
    tensor of format `fmt`, every field [*lead, O, per_row]). Pure jnp and jittable; lossless: the integer
    sub-scales and the fp16 scales are kept as they are."""
    _check_format(fmt)
    codes = stored_codes(fmt, fields)  # [*lead, O, I] u8
    lead, (num_out, num_in) = codes.shape[:-2], codes.shape[-2:]
    if num_in % SUPER[fmt]:
        raise ValueError(f"{fmt}: {num_in} inputs are not whole blocks of {SUPER[fmt]}")
    quads = _quads(codes, num_out)  # [*lead, C, I/4, 16, 4]
    num_panels = quads.shape[-4]
    pairs = (quads & 0x0F).reshape(*lead, num_panels, num_in // 8, 2, PANEL, 4)
    out = {"codes": (pairs[..., 0, :, :] | (pairs[..., 1, :, :] << 4)).reshape(*lead, num_panels, num_in // 8, 4 * PANEL)}
    width = HIGH_BITS[fmt]
    if width:  # a row of 64 high bytes per 32 (1 bit) or 16 (2 bits) inputs: 8 // width quads
        high = (quads >> 4).reshape(*lead, num_panels, num_in * width // 32, 8 // width, PANEL, 4)
        out["high"] = _merge_fields(high, width)
    out["scales"] = _column_panels(jnp.asarray(fields["scales"]), num_out)
    if "mins" in fields:
        out["mins"] = _column_panels(jnp.asarray(fields["mins"]), num_out)
    for name in ("super_scales", "super_mins"):
        if name in fields:
            out[name] = _column_panels(jnp.asarray(fields[name]), num_out)
    expected = PANEL_FIELDS[fmt]
    if tuple(out) != expected:
        raise ValueError(f"{fmt}: fields {sorted(fields)} gave panels {tuple(out)}, expected {expected}")
    return out


def unpack_codes(fmt: str, panels: dict[str, Array], num_in: int) -> Int[Array, "F I"]:
    """One layer's panels -> the unsigned codes [F, I] (int32), column by input."""
    codes = panels["codes"]  # [C, I/8, 64]
    num_panels = codes.shape[0]
    nibbles = jnp.stack([codes & 0x0F, codes >> 4], axis=2).reshape(num_panels, num_in // 8, 2, PANEL, 4)
    quads = nibbles.reshape(num_panels, num_in // 4, PANEL, 4).astype(jnp.int32)  # quad 2u + h
    width = HIGH_BITS[fmt]
    if width:
        high = panels["high"].reshape(num_panels, -1, 1, PANEL, 4).astype(jnp.int32)  # [C, R, 1, 16, 4]
        shifts = (jnp.arange(8 // width, dtype=jnp.int32) * width)[:, None, None]
        fields = (high >> shifts) & ((1 << width) - 1)  # [C, R, 8 // width, 16, 4]
        quads = quads | (fields.reshape(quads.shape) << 4)
    return jnp.transpose(quads, (0, 2, 1, 3)).reshape(num_panels * PANEL, num_in)


def _per_column(a: Array) -> Array:
    """[C, J, 16] -> f32 [F, J]."""
    return jnp.swapaxes(a.astype(jnp.float32), -1, -2).reshape(-1, a.shape[-2])


# ---------------------------------------------------------------- the matmul


def kquant_matmul(
    x: Float[Array, "M I"], panels: dict[str, Array], layer: Int[Array, ""], *, fmt: str, num_in: int, vectorized: bool = True,
    amx: bool = True,
) -> Float[Array, "M F"]:
    """`x @ w[layer]` for `w` packed by `pack` with a leading layer axis N (every panel array [N, C, ...]),
    reading layer `layer` in place. F = 16 C (the padded output). `vectorized=False` runs the kernel's plain
    loop (what a CPU without AVX512-VNNI runs) instead of its VNNI tiles: the same sums. `amx=False` keeps a
    K-quant's many rows off the AMX tiles (where the CPU has them) on the VNNI ones: the same bits."""
    _check_format(fmt)
    if not available():
        raise RuntimeError("the CPU K-quant matmul kernel could not be built; see the warning above")
    if x.shape[-1] != num_in:
        raise ValueError(f"x has {x.shape[-1]} inputs, the weight {num_in}")
    codes = panels["codes"]
    result = jax.ShapeDtypeStruct((x.shape[0], codes.shape[1] * PANEL), jnp.float32)
    empty = jnp.zeros((0,), jnp.uint8)
    args = [panels[name] if name in PANEL_FIELDS[fmt] else empty for name in _ARGS]
    return jax.ffi.ffi_call(TARGET, result)(
        x.astype(jnp.float32), *args, jnp.asarray(layer, jnp.int32), format=np.int32(FORMAT_IDS[fmt]), vectorized=np.int32(2 if vectorized and amx else int(vectorized)),
    )


def _per_column_int(a: Array) -> Array:
    """[C, J, 16] -> int32 [F, J]."""
    return jnp.swapaxes(a.astype(jnp.int32), -1, -2).reshape(-1, a.shape[-2])


def reference(x: Float[Array, "M I"], panels: dict[str, Array], layer: Int[Array, ""], *, fmt: str, num_in: int) -> Float[Array, "M F"]:
    """`kquant_matmul` in jnp: the same quantized activations (per GROUP[fmt] inputs), the same exact int32
    dots and integer sums, and the same f32 scale products (module docstring); only the order of the f32 sums
    over groups differs."""
    _check_format(fmt)
    one = {name: jnp.asarray(a)[layer] for name, a in panels.items()}
    codes = unpack_codes(fmt, one, num_in)  # [F, I]
    num_out, num_rows, group = codes.shape[0], x.shape[0], GROUP[fmt]
    x_codes, x_scale = quantize_activations(x.astype(jnp.float32), group)  # [M, G, group] int8, [M, G]
    sub = 16 if fmt == "q6_k" else 32
    xs = x_codes.astype(jnp.int32).reshape(num_rows, num_in // sub, sub)  # [M, J, sub]
    dots = jnp.einsum("fjk,mjk->mjf", codes.reshape(num_out, num_in // sub, sub), xs, preferred_element_type=jnp.int32)  # [M, J, F]
    sums = jnp.sum(xs, axis=-1)[..., None]  # [M, J, 1]
    sx = x_scale[..., None]  # [M, G, 1]
    if fmt in ("q5_0", "q5_1"):
        scale = _per_column(one["scales"]).T  # [G, F]
        if fmt == "q5_0":
            return jnp.sum(((dots - ZERO_POINT[fmt] * sums).astype(jnp.float32) * sx) * scale, axis=1)
        return jnp.sum((dots.astype(jnp.float32) * sx) * scale + (sx * sums.astype(jnp.float32)) * _per_column(one["mins"]).T, axis=1)
    per_group = (num_rows, num_in // group, group // sub, num_out)  # [M, G, S, F]
    sc = _per_column_int(one["scales"]).T  # [J, F]
    scaled = jnp.sum((sc * dots).reshape(per_group), axis=2)  # [M, G, F]: exact in int32
    weights = sc if fmt == "q6_k" else _per_column_int(one["mins"]).T
    correction = jnp.sum((weights * sums).reshape(per_group), axis=2)  # [M, G, F]
    d = _per_column(one["super_scales"]).T  # [G, F]
    if fmt == "q6_k":
        return jnp.sum((scaled - ZERO_POINT[fmt] * correction).astype(jnp.float32) * (sx * d), axis=1)
    dmin = _per_column(one["super_mins"]).T
    return jnp.sum(scaled.astype(jnp.float32) * (sx * d) - correction.astype(jnp.float32) * (sx * dmin), axis=1)  # [M, F]
