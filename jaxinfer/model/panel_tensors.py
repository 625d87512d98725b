"""The CPU kernels' weight types: `PanelTensor` (a dense f32 matrix cut into the layer-matmul kernel's panels),
`QuantPanelTensor` (a quantized one in the quantized-matmul kernel's panels), `KQuantPanelTensor` (a K-quant
one, each layer's own format kept, in the K-quant kernel's) and `StackedWeight` (one layer of a stacked one,
left in place). Pure types with their widths, so that params.py can name them in `Weight`
without importing panels.py (which imports params.py); panels.py packs and reads them. Also the exact
dequantization of K-quant panels (`kquant_dense`, which params.dense_params needs) and, for a tied embedding kept
once as the head's panels, its lookup (`kquant_take`: the tokens' columns gathered, only those dequantized); the same
two for a tied Q8_0 / Q4_0 / Q4_1 table kept as quantized panels (`quant_dense`, `quant_take`). Imports jax and, lazily,
kernels_cpu/kquant_matmul's jnp unpacking.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

PANEL_WIDTH = 64  # output columns per panel of a PanelTensor (kPanel in kernels_cpu/layer_matmul.cc)
QUANT_PANEL_WIDTH = 16  # output columns per panel of a QuantPanelTensor (kPanel in kernels_cpu/quant_matmul.cc)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PanelTensor:
    """A dense f32 matrix (or stack) `[*lead, *in_shape, *out_shape]` in the CPU layer-matmul kernel's
    layout: `panels [*lead, C, I, PANEL_WIDTH]`, the output axes flattened and cut into C panels of
    PANEL_WIDTH columns (zero-padded), so each panel is one contiguous run of memory. Packed once by the
    engine when it runs the CPU kernels (`pack_panels`); only `einsum` reads it, through the kernel."""

    panels: Array
    in_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    out_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.panels.shape[:-3]) + self.in_shape + self.out_shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantPanelTensor:
    """A quantized matrix (or stack) `[*lead, *in_shape, *out_shape]` in the CPU quantized-matmul kernel's
    layout (kernels_cpu/quant_matmul): unsigned `codes [*lead, C, S, 64]` in C panels of QUANT_PANEL_WIDTH
    columns (C even, zero-padded; S = I / 4 for 8-bit codes, I / 8 for 4-bit), and float16 `scale`, `offset`
    `[*lead, C, I / 32, QUANT_PANEL_WIDTH]` with w = code * scale + offset (quant.affine_blocks). A symmetric
    format (q8_0, int8, q4_0: quant.affine_zero_point) keeps no offsets: w = (code - zero_point) * scale, which
    the kernel subtracts in int32 and which reads 1/2 bit less per weight. Packed once by the engine for
    matmul_impl='cpu_int8' (`pack_panels`), or at load for a tied Q8_0 / Q4_0 / Q4_1 table (layout "out_in", kept once:
    the lookup's `quant_take` and the head read it); `einsum` reads it, W8A8 through the kernel (or dense, `read`)."""

    codes: Array
    scale: Array
    offset: Array | None
    in_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    out_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    zero_point: int = dataclasses.field(default=0, metadata=dict(static=True))  # with offset None
    # How `panels.einsum` multiplies it, as KQuantPanelTensor.read: "kernel", "dense" (dequantized exactly,
    # `quant_dense`, a chunk of columns at a time) or the W8A8 kernels' exact reference's mark.
    read: str = dataclasses.field(default="kernel", metadata=dict(static=True))
    # "in_out", or "out_in": a tied embedding [V, D] (unstacked) kept once, read as the head through `head_view`
    # and row by row by `quant_take`, as KQuantPanelTensor.layout.
    layout: str = dataclasses.field(default="in_out", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        logical = self.out_shape + self.in_shape if self.layout == "out_in" else self.in_shape + self.out_shape
        return tuple(self.codes.shape[:-3]) + logical

    @property
    def format(self) -> str:
        """The GGUF format the panels hold (params.weight_bytes reports it): q8_0 (8-bit codes, zero point 128),
        q4_0 (4-bit, zero point 8) or q4_1 (4-bit, offsets kept)."""
        if self.codes.shape[-2] * 4 == math.prod(self.in_shape):
            return "q8_0"
        return "q4_1" if self.offset is not None else "q4_0"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class KQuantPanelTensor:
    """A K-quant (or Q5_0 / Q5_1) matrix or stack `[*lead, *in_shape, *out_shape]` in the CPU K-quant kernel's
    layout (kernels_cpu/kquant_matmul.pack: exact, the two-level scales kept): `parts[k]` holds the layers
    stored in `formats[k]` (a dict of arrays, each with the leading layer axis of that part), and layer i is
    `parts[layer_part[i]]` at `layer_slot[i]`. A file whose layers share one type has one part and the
    identity table; Q4_K_M's attn_v / ffn_down (Q6_K in some layers, Q4_K in others) have two, picked by
    `lax.switch` inside `panels.einsum`. An unstacked matrix (the head) has no leading axis and a table of
    one entry. Packed once by the engine for matmul_impl='cpu_int8' (`pack_panels`); only `einsum` reads it."""

    parts: tuple[dict, ...]
    formats: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
    layer_part: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    layer_slot: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    in_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    out_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    stacked: bool = dataclasses.field(default=True, metadata=dict(static=True))  # False: one matrix, no leading axis
    # How `panels.einsum` multiplies it: "kernel" (W8A8 through kernels_cpu/kquant_matmul) or "dense" (the layer
    # dequantized exactly, `kquant_dense`, then a plain einsum in the activations' dtype: the f32 reference and
    # the tuner's non-kernel candidates read the same arrays so).
    read: str = dataclasses.field(default="kernel", metadata=dict(static=True))
    # "in_out": a matrix [*in_shape, *out_shape]; "out_in": a tied embedding [*out_shape, *in_shape] (V, D), the same
    # panels read as the head through `head_view` and row by row by `kquant_take` (one copy of the table, not two).
    layout: str = dataclasses.field(default="in_out", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        logical = self.out_shape + self.in_shape if self.layout == "out_in" else self.in_shape + self.out_shape
        return ((len(self.layer_part),) if self.stacked else ()) + logical

    @property
    def format(self) -> str:
        """The formats joined with '+' (what `jaxinfer info` and params.weight_bytes report)."""
        return "+".join(self.formats)


def _per_column(a: Array) -> Array:
    """[C, G, 16] panel scales -> f32 [16 C, G] (column by group)."""
    return jnp.swapaxes(a.astype(jnp.float32), -1, -2).reshape(-1, a.shape[-2])


def _dequantized_rows(fmt: str, codes: Array, fields: dict[str, Array], num_in: int) -> Array:
    """f32 weights [F, I] of F columns from their unsigned codes [F, I] and their scale fields, each f32 [F, J]
    (column by group): the same products, in the same order, as quant.dequantize (every one exact in f32 but
    the final add of a minimum), so bit for bit its values."""
    sub = 16 if fmt == "q6_k" else 32
    codes = codes.astype(jnp.float32).reshape(codes.shape[0], num_in // sub, sub)
    if fmt in ("q4_k", "q5_k"):
        scale = jnp.repeat(fields["super_scales"], 8, axis=1) * fields["scales"]  # [F, I/32]
        minimum = jnp.repeat(fields["super_mins"], 8, axis=1) * fields["mins"]
        rows = scale[..., None] * codes - minimum[..., None]
    elif fmt == "q6_k":
        scale = jnp.repeat(fields["super_scales"], 16, axis=1) * fields["scales"]  # [F, I/16]
        rows = scale[..., None] * (codes - 32.0)
    elif fmt == "q5_0":
        rows = fields["scales"][..., None] * (codes - 16.0)
    else:  # q5_1
        rows = fields["scales"][..., None] * codes + fields["mins"][..., None]
    return rows.reshape(-1, num_in)


_SCALE_FIELDS = ("scales", "mins", "super_scales", "super_mins")


def _layer_rows(fmt: str, one: dict, num_in: int, num_out: int) -> Array:
    """One layer's panels -> its weights f32 [O, I], bit for bit quant.dequantize's."""
    from kernels_cpu import kquant_matmul  # noqa: PLC0415  (jnp only; nothing is built)

    codes = kquant_matmul.unpack_codes(fmt, one, num_in)  # [F, I]
    fields = {name: _per_column(one[name]) for name in _SCALE_FIELDS if name in one}  # [F, J] each
    return _dequantized_rows(fmt, codes, fields, num_in)[:num_out]


def _column_codes(fmt: str, one: dict, panel: Array, column: Array, num_in: int) -> Array:
    """The unsigned codes int32 [T, I] of T columns, column[t] of panel[t] (the `pack` layout, kernels_cpu/kquant_matmul)."""
    from kernels_cpu import kquant_matmul  # noqa: PLC0415

    def picked(a: Array) -> Array:  # [C, R, 64] -> the column's 4 bytes of every row, [T, R, 4]
        return a.reshape(a.shape[0], a.shape[1], kquant_matmul.PANEL, 4)[panel, :, column, :].astype(jnp.int32)

    low = picked(one["codes"])  # row u: inputs 8u + i (low nibbles), 8u + 4 + i (high)
    codes = jnp.stack([low & 0x0F, low >> 4], axis=-2).reshape(low.shape[0], num_in)
    width = kquant_matmul.HIGH_BITS[fmt]
    if width:  # row g, field s of the byte (bits s * width ..): input g * 32 / width + 4 s + i
        high = picked(one["high"])[..., None, :]  # [T, R, 1, 4]
        shifts = (jnp.arange(8 // width, dtype=jnp.int32) * width)[:, None]  # [8 / width, 1]
        codes = codes | ((((high >> shifts) & ((1 << width) - 1)).reshape(codes.shape)) << 4)
    return codes


def kquant_take(w: KQuantPanelTensor, indices: Array, dtype=jnp.float32) -> Array:
    """Rows `w[indices]` of an unstacked one-part embedding in panels ([*indices.shape, *in_shape]): each token's
    column gathered from its panel, then only those rows dequantized (bit for bit quant.dequantize's values)."""
    from kernels_cpu import kquant_matmul  # noqa: PLC0415

    if w.stacked or len(w.parts) != 1 or len(w.out_shape) != 1:
        raise ValueError(f"kquant_take reads one unstacked matrix of one format; got {w.stacked=}, {w.formats=}, {w.out_shape=}")
    (one,), (fmt,), num_in = w.parts, w.formats, math.prod(w.in_shape)
    flat = jnp.clip(jnp.reshape(indices, (-1,)), 0, w.out_shape[0] - 1)  # [T]; clipped as quant.take's gather
    panel, column = flat // kquant_matmul.PANEL, flat % kquant_matmul.PANEL
    codes = _column_codes(fmt, one, panel, column, num_in)  # [T, I]
    fields = {name: one[name][panel, :, column].astype(jnp.float32) for name in _SCALE_FIELDS if name in one}  # [T, J]
    rows = _dequantized_rows(fmt, codes, fields, num_in)  # [T, I]
    return rows.reshape(*jnp.shape(indices), *w.in_shape).astype(dtype)


def _affine_values(quads: Array, scale: Array, offset: Array | None, zero_point: int, num_in: int) -> Array:
    """f32 weights [F, I] of F columns from their panel rows `quads` int32 [F, S, 4] (S = I / 4 bytes of 8-bit codes,
    or I / 8 of 4-bit ones: row s holds inputs 8s + i in its low nibbles and 8s + 4 + i in its high ones) and their
    scale and offset, each f32 [F, I / 32] (offset None: -zero_point * scale): code * scale + offset, exact for the
    GGUF formats (quant.affine_blocks), so quant.dequantize's values bit for bit."""
    if quads.shape[1] * 8 == num_in:  # 4-bit
        quads = jnp.stack([quads & 0x0F, quads >> 4], axis=-2)  # [F, S, 2, 4]
    codes = quads.astype(jnp.float32).reshape(quads.shape[0], num_in // 32, 32)
    offset = -float(zero_point) * scale if offset is None else offset
    return (codes * scale[..., None] + offset[..., None]).reshape(-1, num_in)


def _one_matrix(w: QuantPanelTensor, caller: str) -> None:
    if w.codes.ndim != 3 or len(w.out_shape) != 1:
        raise ValueError(f"{caller} reads one unstacked matrix with one output axis; got codes {w.codes.shape}, {w.out_shape=}")


def quant_take(w: QuantPanelTensor, indices: Array, dtype=jnp.float32) -> Array:
    """Rows `w[indices]` of an unstacked tied embedding in quantized panels ([*indices.shape, *in_shape]): each token's
    column gathered from its panel, then only those rows dequantized (bit for bit quant.dequantize's values)."""
    _one_matrix(w, "quant_take")
    num_in = math.prod(w.in_shape)
    flat = jnp.clip(jnp.reshape(indices, (-1,)), 0, w.out_shape[0] - 1)  # [T]; clipped as quant.take's gather
    panel, column = flat // QUANT_PANEL_WIDTH, flat % QUANT_PANEL_WIDTH
    codes = w.codes.reshape(*w.codes.shape[:2], QUANT_PANEL_WIDTH, 4)[panel, :, column, :].astype(jnp.int32)  # [T, S, 4]

    def picked(a):  # [C, I/32, 16] -> the tokens' columns f32 [T, I/32]
        return None if a is None else a[panel, :, column].astype(jnp.float32)

    rows = _affine_values(codes, picked(w.scale), picked(w.offset), w.zero_point, num_in)  # [T, I]
    return rows.reshape(*jnp.shape(indices), *w.in_shape).astype(dtype)


def quant_dense(w: QuantPanelTensor, dtype=jnp.float32) -> Array:
    """An unstacked QuantPanelTensor dequantized exactly, in its logical shape ([*in_shape, *out_shape], or a tied
    embedding's [*out_shape, *in_shape])."""
    _one_matrix(w, "quant_dense")
    num_in, num_out, num_panels = math.prod(w.in_shape), w.out_shape[0], w.codes.shape[0]
    quads = jnp.swapaxes(w.codes.reshape(num_panels, -1, QUANT_PANEL_WIDTH, 4), 1, 2).astype(jnp.int32)  # [C, 16, S, 4]

    def by_column(a):  # [C, I/32, 16] -> f32 [16 C, I/32]
        return None if a is None else jnp.swapaxes(a.astype(jnp.float32), 1, 2).reshape(-1, a.shape[1])

    rows = _affine_values(quads.reshape(-1, *quads.shape[2:]), by_column(w.scale), by_column(w.offset), w.zero_point, num_in)[:num_out]
    if w.layout == "out_in":
        return rows.reshape(*w.out_shape, *w.in_shape).astype(dtype)
    return rows.T.reshape(*w.in_shape, *w.out_shape).astype(dtype)


def head_view(w):
    """A tied embedding's panels (KQuantPanelTensor or QuantPanelTensor, layout "out_in", [V, D]) as the head's
    [D, V] matrix: the same arrays."""
    return dataclasses.replace(w, layout="in_out")


def kquant_dense(w: KQuantPanelTensor, index=None, dtype=jnp.float32) -> Array:
    """Layer `index` (a traced int; None for an unstacked matrix) of `w` dequantized, in its logical shape
    ([*in_shape, *out_shape], or an embedding's [*out_shape, *in_shape]); the part holding it is picked by `lax.switch` when the layers mix formats."""
    num_in, num_out = math.prod(w.in_shape), math.prod(w.out_shape)

    def branch(part: int):
        def run(slot):
            one = {name: (a[slot] if w.stacked else a) for name, a in w.parts[part].items()}
            rows = _layer_rows(w.formats[part], one, num_in, num_out)  # [O, I]
            if w.layout == "out_in":  # an embedding: its rows as they are, [*out_shape, *in_shape]
                return rows.reshape(*w.out_shape, *w.in_shape).astype(dtype)
            return rows.T.reshape(*w.in_shape, *w.out_shape).astype(dtype)
        return run

    if index is None or len(w.parts) == 1:
        return branch(0)(index)
    part_of = jnp.asarray(w.layer_part, jnp.int32)[index]
    slot_of = jnp.asarray(w.layer_slot, jnp.int32)[index]
    return jax.lax.switch(part_of, [branch(k) for k in range(len(w.parts))], slot_of)


def kquant_dense_stack(w: KQuantPanelTensor, dtype=jnp.float32) -> Array:
    """Every layer of `w` dequantized: [N, *in_shape, *out_shape] (or the one matrix when unstacked)."""
    if not w.stacked:
        return kquant_dense(w, None, dtype)
    return jnp.stack([kquant_dense(w, jnp.int32(i), dtype) for i in range(len(w.layer_part))])


class StackedWeight(NamedTuple):
    """Layer `index` of a stacked PanelTensor, left in place: `einsum` reads it with the CPU layer-matmul
    kernel (kernels_cpu/layer_matmul) instead of slicing a copy out."""

    stack: PanelTensor | QuantPanelTensor | KQuantPanelTensor
    index: jax.Array
