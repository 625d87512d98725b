"""The CPU kernels' weight types: `PanelTensor` (a dense f32 matrix cut into the layer-matmul kernel's panels),
`QuantPanelTensor` (a quantized one in the quantized-matmul kernel's panels), `KQuantPanelTensor` (a K-quant
one, each layer's own format kept, in the K-quant kernel's) and `StackedWeight` (one layer of a stacked one,
left in place). Pure types with their widths, so that params.py can name them in `Weight`
without importing panels.py (which imports params.py); panels.py packs and reads them. Imports jax only.
"""

import dataclasses
from typing import NamedTuple

import jax
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
    matmul_impl='cpu_int8' (`pack_panels`); only `einsum` reads it, W8A8 through the kernel."""

    codes: Array
    scale: Array
    offset: Array | None
    in_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    out_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    zero_point: int = dataclasses.field(default=0, metadata=dict(static=True))  # with offset None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape[:-3]) + self.in_shape + self.out_shape


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

    @property
    def shape(self) -> tuple[int, ...]:
        return ((len(self.layer_part),) if self.stacked else ()) + self.in_shape + self.out_shape


class StackedWeight(NamedTuple):
    """Layer `index` of a stacked PanelTensor, left in place: `einsum` reads it with the CPU layer-matmul
    kernel (kernels_cpu/layer_matmul) instead of slicing a copy out."""

    stack: PanelTensor | QuantPanelTensor | KQuantPanelTensor
    index: jax.Array
