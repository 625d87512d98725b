"""The CPU kernels' weight layout, in one place: panels, packing the params into them, and the in-place scan.

Owns `PanelTensor` (a dense f32 matrix cut into the layer-matmul kernel's panels), `StackedWeight` (one
layer of a stacked PanelTensor, left in place), `pack_panels` (the engine's step params for the CPU
kernels), `einsum` (the only reader of panels, through kernels_cpu/layer_matmul) and the layer scan that
passes each layer's panels in place. The engine keeps the loaded params beside the packed ones, so the
reference paths never see a panel. Imports jax, params (for the weight table) and, lazily, the CPU
kernel; model.py imports this module, never the reverse.

Why in place: `lax.scan` over stacked weights hands each layer a slice, which XLA:CPU copies out of
the stack before a custom call reads it; the kernel instead gets the whole stack and the layer index.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxinfer.params import LayerParams, Params

PANEL_WIDTH = 64  # output columns per panel of a PanelTensor (kPanel in kernels_cpu/layer_matmul.cc)


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


class StackedWeight(NamedTuple):
    """Layer `index` of a stacked PanelTensor, left in place: `einsum` reads it with the CPU layer-matmul
    kernel (kernels_cpu/layer_matmul) instead of slicing a copy out."""

    stack: PanelTensor
    index: jax.Array


def is_panel(w) -> bool:
    """Whether `w` is in the CPU kernel's layout (read by `einsum`, not by quant.qeinsum)."""
    return isinstance(w, (PanelTensor, StackedWeight))


def to_panels(w: Float[Array, "..."], num_lead: int, num_in: int) -> PanelTensor:
    """Pack dense `w` [*lead, *in, *out] (num_lead leading axes, num_in input axes) into a PanelTensor."""
    lead, in_shape, out_shape = w.shape[:num_lead], w.shape[num_lead : num_lead + num_in], w.shape[num_lead + num_in :]
    rows, cols = math.prod(in_shape), math.prod(out_shape)
    padded = -(-cols // PANEL_WIDTH) * PANEL_WIDTH
    flat = jnp.pad(w.reshape(*lead, rows, cols).astype(jnp.float32), [(0, 0)] * num_lead + [(0, 0), (0, padded - cols)])
    panels = flat.reshape(*lead, rows, padded // PANEL_WIDTH, PANEL_WIDTH)  # [*lead, I, C, PANEL_WIDTH]
    return PanelTensor(panels=jnp.moveaxis(panels, -2, -3), in_shape=tuple(in_shape), out_shape=tuple(out_shape))


def einsum(spec: str, x: Float[Array, "..."], w: PanelTensor | StackedWeight, *, preferred_element_type=None) -> Float[Array, "..."]:
    """`jnp.einsum(spec, x, w)` through the CPU layer-matmul kernel, for a plain "rows @ matrix" spec: w's
    input subscripts contracted against x's trailing ones, the output x's other subscripts, then w's.
    A PanelTensor is one matrix (or the layer slice a plain scan took); a StackedWeight is read in place."""
    from kernels_cpu import layer_matmul  # noqa: PLC0415  (CPU only; built on first use)

    if isinstance(w, PanelTensor):
        w = StackedWeight(dataclasses.replace(w, panels=w.panels[None]), jnp.int32(0))
    inputs, _, output = spec.replace(" ", "").partition("->")
    x_subs, _, w_subs = inputs.partition(",")
    contracted = len(w.stack.in_shape)
    batch, kept = x_subs[: len(x_subs) - contracted], w_subs[contracted:]
    if x_subs[len(batch):] != w_subs[:contracted] or output != batch + kept or preferred_element_type not in (None, jnp.float32):
        raise ValueError(f"a PanelTensor {w.stack.shape} is read only by the CPU kernel, as rows @ matrix in f32; got {spec!r}")
    rows, depth = math.prod(x.shape[: len(batch)]), math.prod(x.shape[len(batch):])
    out = layer_matmul.layer_matmul(x.reshape(rows, depth), w.stack.panels, w.index)  # [rows, C * PANEL_WIDTH]
    return out[:, : math.prod(w.stack.out_shape)].reshape(*x.shape[: len(batch)], *w.stack.out_shape)


def _dense_f32(value) -> bool:
    return isinstance(value, jax.Array) and value.dtype == jnp.float32


def pack_panels(params: Params) -> Params:
    """The engine's step params for the CPU kernels: every dense f32 layer matrix and the LM head as a
    PanelTensor. A tied head gets its own [D, V] panels (the embedding stays for the lookup), so it costs
    one more copy of the table. Quantized weights, norms and biases are the loaded arrays themselves."""
    matrices = [spec for spec in params.specs if spec.stacked and spec.num_in]  # the weight table's layer matmuls
    layers = {spec.name: to_panels(getattr(params.layers, spec.name), 1, spec.num_in)
              for spec in matrices if _dense_f32(getattr(params.layers, spec.name))}
    head = params.lm_head
    if head is None and _dense_f32(params.embed):
        head = to_panels(params.embed.T, 0, 1)  # [D, V]
    elif _dense_f32(head):
        head = to_panels(head, 0, 1)
    return dataclasses.replace(params, layers=dataclasses.replace(params.layers, **layers), lm_head=head)


def is_packed(layers: LayerParams) -> bool:
    """Whether any layer matrix is in panels (then the layers scan in place: `scan_in_place`)."""
    return any(isinstance(getattr(layers, f.name), PanelTensor) for f in dataclasses.fields(layers))


def layer_in_place(layers: LayerParams, index: Int[Array, ""]) -> LayerParams:
    """Layer `index` of the stack: panel matrices as StackedWeight (read in place by `einsum`),
    everything else (norms, biases, dense or quantized matrices) sliced as the scan would."""
    def pick(value):
        if isinstance(value, PanelTensor):
            return StackedWeight(value, index)
        return None if value is None else jax.tree.map(lambda leaf: leaf[index], value)

    return dataclasses.replace(layers, **{f.name: pick(getattr(layers, f.name)) for f in dataclasses.fields(layers)})


def scan_in_place(body: Callable, carry, layers: LayerParams, layer_index: Int[Array, "N"]):
    """`lax.scan(body, carry, (layers, layer_index))` over the layer index alone: each step hands `body`
    (layer_in_place(layers, i), i), so the panel stacks stay whole. Returns what the scan returns."""
    def body_in_place(carry, index):
        return body(carry, (layer_in_place(layers, index), index))

    return jax.lax.scan(body_in_place, carry, layer_index)
