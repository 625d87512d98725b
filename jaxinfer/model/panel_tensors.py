"""The CPU kernels' weight types: `PanelTensor` (a dense f32 matrix cut into the layer-matmul kernel's panels),
`QuantPanelTensor` (a quantized one in the quantized-matmul kernel's panels) and `StackedWeight` (one layer of
a stacked one, left in place). Pure types with their widths, so that params.py can name them in `Weight`
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


class StackedWeight(NamedTuple):
    """Layer `index` of a stacked PanelTensor, left in place: `einsum` reads it with the CPU layer-matmul
    kernel (kernels_cpu/layer_matmul) instead of slicing a copy out."""

    stack: PanelTensor | QuantPanelTensor
    index: jax.Array
