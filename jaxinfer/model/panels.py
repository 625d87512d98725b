"""The CPU kernels' weight layout, in one place: panels, packing the params into them, and the in-place scan.

Uses the types of panel_tensors.py (`PanelTensor`, `QuantPanelTensor`, `StackedWeight`); owns `pack_panels` (the engine's step params for the CPU
kernels), `einsum` (the only reader of panels, through kernels_cpu/layer_matmul) and the layer scan that
passes each layer's panels in place. The engine keeps the loaded params beside the packed ones, so the
reference paths never see a panel. Imports jax, params (for the weight table) and, lazily, the CPU
kernel; model.py imports this module, never the reverse.

Why in place: `lax.scan` over stacked weights hands each layer a slice, which XLA:CPU copies out of
the stack before a custom call reads it; the kernel instead gets the whole stack and the layer index.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxinfer.model import mixed_quant, quant, w8a8_reference
from jaxinfer.model.mixed_quant import MixedQuantStack
from jaxinfer.model.panel_tensors import (  # noqa: F401  (the types, named where they are used)
    PANEL_WIDTH, QUANT_PANEL_WIDTH, KQuantPanelTensor, PanelTensor, QuantPanelTensor, StackedWeight, kquant_dense, quant_dense,
)
from jaxinfer.model.params import WEIGHTS, LayerParams, Params
from kernels_cpu import kquant_matmul  # its packing and reference are jnp; the kernel is built on first use (available())

def is_panel(w) -> bool:
    """Whether `w` is in the CPU kernel's layout, or one layer of a stack read in place (read by `einsum`,
    not by quant.qeinsum)."""
    return isinstance(w, (PanelTensor, QuantPanelTensor, KQuantPanelTensor, StackedWeight, w8a8_reference.FakeQuantWeight))


def to_panels(w: Float[Array, "..."], num_lead: int, num_in: int) -> PanelTensor:
    """Pack dense `w` [*lead, *in, *out] (num_lead leading axes, num_in input axes) into a PanelTensor."""
    lead, in_shape, out_shape = w.shape[:num_lead], w.shape[num_lead : num_lead + num_in], w.shape[num_lead + num_in :]
    rows, cols = math.prod(in_shape), math.prod(out_shape)
    padded = -(-cols // PANEL_WIDTH) * PANEL_WIDTH
    flat = jnp.pad(w.reshape(*lead, rows, cols).astype(jnp.float32), [(0, 0)] * num_lead + [(0, 0), (0, padded - cols)])
    panels = flat.reshape(*lead, rows, padded // PANEL_WIDTH, PANEL_WIDTH)  # [*lead, I, C, PANEL_WIDTH]
    return PanelTensor(panels=jnp.moveaxis(panels, -2, -3), in_shape=tuple(in_shape), out_shape=tuple(out_shape))


def to_quant_panels(q: quant.QuantizedTensor) -> QuantPanelTensor:
    """Pack a quantized matrix or stack of an affine format (quant.AFFINE_FORMATS) into a QuantPanelTensor."""
    codes, scale, offset = quant.affine_blocks(q)  # [*lead, O, I], [*lead, O, I/32] x 2
    lead, (cols, rows) = codes.shape[:-2], codes.shape[-2:]
    pair = 2 * QUANT_PANEL_WIDTH  # the kernel's column tile is two panels
    pad = [(0, 0)] * len(lead) + [(0, -(-cols // pair) * pair - cols), (0, 0)]
    codes, scale, offset = (jnp.pad(a, pad) for a in (codes, scale, offset))
    num_panels = codes.shape[-2] // QUANT_PANEL_WIDTH
    codes = codes.reshape(*lead, num_panels, QUANT_PANEL_WIDTH, rows // 4, 4)
    codes = jnp.swapaxes(codes, -3, -2)  # [*lead, C, I/4, 16, 4]: input quads by column
    if q.bits == 4:  # rows s of 8 inputs: quad 2s in the low nibbles, quad 2s + 1 in the high ones
        quads = codes.reshape(*lead, num_panels, rows // 8, 2, QUANT_PANEL_WIDTH, 4)
        codes = quads[..., 0, :, :] | (quads[..., 1, :, :] << 4)
    codes = codes.reshape(*lead, num_panels, -1, 4 * QUANT_PANEL_WIDTH)

    def blocks(a):  # [*lead, O, I/32] -> [*lead, C, I/32, 16] float16
        return jnp.swapaxes(a.reshape(*lead, num_panels, QUANT_PANEL_WIDTH, -1), -2, -1).astype(jnp.float16)

    zero_point = quant.affine_zero_point(q.format)
    kept_offset = None if zero_point is not None else blocks(offset)
    return QuantPanelTensor(codes=codes, scale=blocks(scale), offset=kept_offset, zero_point=zero_point or 0, in_shape=q.in_shape, out_shape=q.out_shape)


def to_kquant_panels(value: quant.QuantizedTensor | MixedQuantStack) -> KQuantPanelTensor:
    """Pack a K-quant (or Q5_0 / Q5_1) matrix, stack or mixed stack into a KQuantPanelTensor, one jitted
    `kquant_matmul.pack` per part: exact, each layer in the format it was stored in."""
    stacked = isinstance(value, MixedQuantStack) or value.codes.ndim > 2
    if isinstance(value, MixedQuantStack):
        parts, layer_part, layer_slot = value.parts, value.layer_part, value.layer_slot
    else:
        count = value.codes.shape[0] if stacked else 1
        parts, layer_part, layer_slot = (value,), (0,) * count, tuple(range(count))
    pack = _kquant_pack if stacked else _kquant_pack_by_rows
    return KQuantPanelTensor(
        parts=tuple(pack(part.format, quant.array_fields(part)) for part in parts), formats=tuple(part.format for part in parts),
        layer_part=layer_part, layer_slot=layer_slot, in_shape=parts[0].in_shape, out_shape=parts[0].out_shape, stacked=stacked,
    )


def _kquant_rows(x: Float[Array, "M I"], w: KQuantPanelTensor, index: Int[Array, ""]) -> Float[Array, "M O"]:
    """`x @ w[index]` for a stacked KQuantPanelTensor: the kernel (its jnp reference where the kernel could
    not be built) on the part that stores layer `index`, chosen by `lax.switch` when the layers mix formats."""
    matmul = kquant_matmul.kquant_matmul if kquant_matmul.available() else kquant_matmul.reference
    num_in, num_out = math.prod(w.in_shape), math.prod(w.out_shape)

    def branch(part: int):
        def run(slot):
            return matmul(x, w.parts[part], slot, fmt=w.formats[part], num_in=num_in)[:, :num_out]  # [M, O]
        return run

    if len(w.parts) == 1:  # one format: the table is the identity
        return branch(0)(index)
    part_of = jnp.asarray(w.layer_part, jnp.int32)[index]
    slot_of = jnp.asarray(w.layer_slot, jnp.int32)[index]
    return jax.lax.switch(part_of, [branch(k) for k in range(len(w.parts))], slot_of)


def einsum(spec: str, x: Float[Array, "..."], w: PanelTensor | QuantPanelTensor | KQuantPanelTensor | StackedWeight, *,
           preferred_element_type=None) -> Float[Array, "..."]:
    """`jnp.einsum(spec, x, w)` through a CPU kernel, for a plain "rows @ matrix" spec: w's input subscripts
    contracted against x's trailing ones, the output x's other subscripts, then w's. A PanelTensor goes
    through the layer-matmul kernel in f32, a QuantPanelTensor through the quantized one and a KQuantPanelTensor
    through the K-quant one (both W8A8); either is one matrix (or the layer slice a plain scan took), and a
    StackedWeight is read in place."""
    from kernels_cpu import layer_matmul, quant_matmul  # noqa: PLC0415  (CPU only; built on first use)

    if isinstance(w, w8a8_reference.FakeQuantWeight):  # the W8A8 kernels' exact reference (w8a8_reference.py)
        return w8a8_reference.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    if _reads_dense(w):
        x = _fake_quantized_if_marked(x, w)
        inputs, _, output = spec.replace(" ", "").partition("->")
        if _one_head_matrix(w) and output[-1:] == inputs[-1:]:
            return _dense_einsum_by_columns(spec, x, w, preferred_element_type)  # a head: never its whole table in f32
        return jnp.einsum(spec, x, _dense_layer(w, x.dtype), preferred_element_type=preferred_element_type)
    if isinstance(w, (PanelTensor, QuantPanelTensor)):
        w = StackedWeight(jax.tree.map(lambda leaf: leaf[None], w), jnp.int32(0))
    elif isinstance(w, KQuantPanelTensor):
        w = StackedWeight(w if w.stacked else dataclasses.replace(jax.tree.map(lambda leaf: leaf[None], w), stacked=True), jnp.int32(0))
    inputs, _, output = spec.replace(" ", "").partition("->")
    x_subs, _, w_subs = inputs.partition(",")
    contracted = len(w.stack.in_shape)
    batch, kept = x_subs[: len(x_subs) - contracted], w_subs[contracted:]
    if x_subs[len(batch):] != w_subs[:contracted] or output != batch + kept or preferred_element_type not in (None, jnp.float32):
        raise ValueError(f"a {type(w.stack).__name__} {w.stack.shape} is read only by a CPU kernel, as rows @ matrix in f32; got {spec!r}")
    rows, depth = math.prod(x.shape[: len(batch)]), math.prod(x.shape[len(batch):])
    if isinstance(w.stack, KQuantPanelTensor):
        return _kquant_rows(x.reshape(rows, depth), w.stack, w.index).reshape(*x.shape[: len(batch)], *w.stack.out_shape).astype(x.dtype)
    if isinstance(w.stack, QuantPanelTensor):
        stack = w.stack
        out = quant_matmul.quant_matmul(x.reshape(rows, depth), stack.codes, stack.scale, stack.offset, w.index, zero_point=stack.zero_point)
    else:
        out = layer_matmul.layer_matmul(x.reshape(rows, depth), w.stack.panels, w.index)  # [rows, C * PANEL_WIDTH]
    return out[:, : math.prod(w.stack.out_shape)].reshape(*x.shape[: len(batch)], *w.stack.out_shape).astype(x.dtype)


def _reads_dense(w) -> bool:
    """A weight `einsum` dequantizes (one layer) and multiplies with a plain einsum: a MixedQuantStack layer,
    or K-quant panels marked read="dense"."""
    stack = w.stack if isinstance(w, StackedWeight) else w
    return isinstance(stack, MixedQuantStack) or (isinstance(stack, (KQuantPanelTensor, QuantPanelTensor)) and stack.read in ("dense", w8a8_reference.READ))


def _one_head_matrix(w) -> bool:
    """An unstacked panel matrix of one format and one output axis (a head, or a tied table read as one)."""
    if isinstance(w, QuantPanelTensor):
        return w.codes.ndim == 3 and len(w.out_shape) == 1
    return isinstance(w, KQuantPanelTensor) and not w.stacked and len(w.parts) == 1 and len(w.out_shape) == 1


def _fake_quantized_if_marked(x: Float[Array, "..."], w) -> Float[Array, "..."]:
    """x fake-quantized as the K-quant kernel quantizes it where `w` is K-quant panels marked read=w8a8_reference.READ
    (the kernels' exact reference), else x: its trailing axes flattened into rows of the weight's inputs (a dense
    read's spec is rows @ matrix, as the kernel's)."""
    stack, index = (w.stack, w.index) if isinstance(w, StackedWeight) else (w, None)
    if not (isinstance(stack, (KQuantPanelTensor, QuantPanelTensor)) and stack.read == w8a8_reference.READ):
        return x
    rows = x.reshape(-1, math.prod(stack.in_shape))  # [M, I]
    if isinstance(stack, QuantPanelTensor):  # an affine format: blocks of 32, as the quantized kernel reads it
        return w8a8_reference.fake_quantize(rows, w8a8_reference.activation_block(stack.format)).reshape(x.shape).astype(x.dtype)
    return w8a8_reference.fake_quantize_for(rows, stack, index if stack.stacked else None).reshape(x.shape).astype(x.dtype)


def _dense_layer(w, dtype) -> Float[Array, "..."]:
    """The one matrix `w` (or StackedWeight layer) of a `_reads_dense` weight, dequantized exactly to `dtype`."""
    stack, index = (w.stack, w.index) if isinstance(w, StackedWeight) else (w, None)
    if isinstance(stack, MixedQuantStack):
        return mixed_quant.layer_dense(stack, index, dtype)
    if isinstance(stack, QuantPanelTensor):  # unstacked only: a tied table kept as the head's panels
        return quant_dense(stack, dtype)
    return kquant_dense(stack, index, dtype)


def _dense_einsum_by_columns(spec: str, x: Float[Array, "..."], w: KQuantPanelTensor | QuantPanelTensor, preferred_element_type) -> Float[Array, "..."]:
    """`jnp.einsum(spec, x, dequantized w)` for one unstacked K-quant matrix whose output axis is the spec's last,
    PACK_ROWS output columns at a time (the chunks' outputs joined), so at most one chunk is ever dequantized:
    a tied 128k-row head is not expanded whole (1 GiB of f32 for Llama-3.2's)."""
    width = QUANT_PANEL_WIDTH if isinstance(w, QuantPanelTensor) else kquant_matmul.PANEL
    per, num_out = PACK_ROWS // width, w.out_shape[0]  # panels per chunk
    outs = []
    for first in range(0, -(-num_out // width), per):
        cols = min(per * width, num_out - first * width)
        chunk = vocab_slice(w, first * width, first * width + cols, tied=False)
        dense = quant_dense(chunk, x.dtype) if isinstance(w, QuantPanelTensor) else kquant_dense(chunk, None, x.dtype)
        outs.append(jnp.einsum(spec, x, dense, preferred_element_type=preferred_element_type))
    return jnp.concatenate(outs, axis=-1)


def with_packed_head(params: Params, read: str = "dense") -> Params:
    """`params` with a tied K-quant embedding's head given as its own K-quant panels (read=`read`; the same
    values: the embedding's rows are the head's columns), so a dense read dequantizes it a chunk of columns at a
    time (`einsum`) instead of the whole [V, D] table per step. Other params are returned as they are."""
    if params.lm_head is not None or not _kquant(params.embed) or isinstance(params.embed, KQuantPanelTensor):
        return params
    return dataclasses.replace(params, lm_head=dataclasses.replace(to_kquant_panels(params.embed), read=read))


def with_read(params: Params, read: str) -> Params:
    """`params` with every KQuantPanelTensor marked read=`read` ("kernel" or "dense"): the same arrays; `params`
    itself when it holds none."""
    marked = (KQuantPanelTensor, QuantPanelTensor)  # loaded params hold a QuantPanelTensor only as a tied table kept once
    if not any(isinstance(leaf, marked) for leaf in jax.tree.leaves(params, is_leaf=is_quantized_weight)):
        return params

    def mark(leaf):
        return dataclasses.replace(leaf, read=read) if isinstance(leaf, marked) else leaf

    return jax.tree.map(mark, params, is_leaf=lambda leaf: isinstance(leaf, marked))


def _dense_f32(value) -> bool:
    return isinstance(value, jax.Array) and value.dtype == jnp.float32


def _affine(value) -> bool:
    return isinstance(value, quant.QuantizedTensor) and value.format in quant.AFFINE_FORMATS and math.prod(value.in_shape) % 32 == 0


def _kquant(value) -> bool:
    """A matrix (stack, or mixed stack) the K-quant kernel reads: every layer in KQUANT_FORMATS, whole blocks."""
    if isinstance(value, KQuantPanelTensor):
        return True
    parts = value.parts if isinstance(value, MixedQuantStack) else (value,) if isinstance(value, quant.QuantizedTensor) else ()
    return bool(parts) and all(p.format in kquant_matmul.FORMATS and math.prod(p.in_shape) % kquant_matmul.SUPER[p.format] == 0 for p in parts)


def is_quantized_weight(leaf) -> bool:
    """A quantized matrix as loaded: QuantizedTensor, MixedQuantStack or K-quant panels (a pytree `is_leaf`)."""
    return isinstance(leaf, (quant.QuantizedTensor, MixedQuantStack, KQuantPanelTensor, QuantPanelTensor))


def has_affine_weights(params: Params) -> bool:
    """Whether any matrix of `params` is quantized in a format a quantized CPU kernel reads: the affine ones
    (quant.AFFINE_FORMATS, kernels_cpu/quant_matmul) or the K-quants, Q5_0 and Q5_1 (kernels_cpu/kquant_matmul),
    mixed stacks included. Matmul 'cpu_int8' packs them all."""
    return any(kernel_reads(leaf) for leaf in jax.tree.leaves(params, is_leaf=is_quantized_weight))


def kernel_reads(value) -> bool:
    """Whether a quantized CPU kernel reads matrix `value` under matmul 'cpu_int8' (`pack_panels`: `_affine` or `_kquant`,
    or a tied affine table packed at load)."""
    return _affine(value) or _kquant(value) or isinstance(value, QuantPanelTensor)


def has_kquant_weights(params: Params) -> bool:
    """Whether any matrix of `params` is one the K-quant kernel reads (`_kquant`)."""
    return any(_kquant(leaf) for leaf in jax.tree.leaves(params, is_leaf=is_quantized_weight))


def pack_panels(params: Params, *, quantized: bool = False) -> Params:
    """The engine's step params for the CPU kernels: every dense f32 layer matrix and the LM head as a
    PanelTensor and, with `quantized` (matmul_impl='cpu_int8'), every matrix of an affine quantized format
    as a QuantPanelTensor. A tied head gets its own [D, V] panels (the embedding stays for the lookup), so
    it costs one more copy of the table. With `quantized`, K-quant matrices (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1;
    a mixed stack part by part) become KQuantPanelTensors, and a tied K-quant embedding gets its packed head
    (one more quantized copy of the table, never a dense one). Other quantized weights (mixed stacks the
    kernels cannot read are dequantized one layer at a time in the scan), norms and biases are the loaded arrays."""
    def pack(value, num_lead: int, num_in: int):
        if _dense_f32(value):
            return _to_panels(value, num_lead, num_in)
        if isinstance(value, (KQuantPanelTensor, QuantPanelTensor)):  # packed at load (loading/kept_blocks.py): the same arrays, read by the
            return dataclasses.replace(value, read="kernel" if quantized else "dense")  # kernel only under 'cpu_int8'
        if quantized and _kquant(value):
            return to_kquant_panels(value)
        return _to_quant_panels(value) if quantized and _affine(value) else value

    matrices = [spec for spec in WEIGHTS if spec.stacked and spec.num_in]  # the weight table's layer matmuls
    layers = {spec.name: pack(getattr(params.layers, spec.name), 1, spec.num_in) for spec in matrices}
    head = params.lm_head
    if head is None and _dense_f32(params.embed):
        head = _head_panels(params.embed)  # [D, V]
    elif head is None and quantized and _affine(params.embed):
        head = _to_quant_panels(params.embed)  # an out_in [V, D] embedding is the [D] -> [V] matrix of the head
    elif head is None and quantized and _kquant(params.embed) and not isinstance(params.embed, KQuantPanelTensor):
        head = to_kquant_panels(params.embed)  # the same rows, in the K-quant kernel's panels
    elif head is not None:
        head = pack(head, 0, 1)
    embed = pack(params.embed, 0, 1) if isinstance(params.embed, (KQuantPanelTensor, QuantPanelTensor)) else params.embed  # a tied head packed at load
    return dataclasses.replace(params, embed=embed, layers=dataclasses.replace(params.layers, **layers), lm_head=head)


_to_quant_panels = jax.jit(to_quant_panels)  # one fused repack per tensor, not an eager temporary per step

_kquant_pack = jax.jit(kquant_matmul.pack, static_argnums=0)  # one fused repack per tensor part (jnp; builds nothing)
PACK_ROWS = 8192  # output rows packed at a time for one large matrix (a tied head's [V, D] table): transients stay small


def _kquant_pack_by_rows(fmt: str, fields: dict) -> dict:
    """`kquant_matmul.pack` of one unstacked matrix, PACK_ROWS output rows at a time (whole column tiles, so the
    panels of the chunks are consecutive), each chunk written in place into the panels preallocated for the whole
    matrix: the packed table exists once, beside one chunk (not the chunks and their concatenation: 2x)."""
    rows = fields["codes"].shape[0]
    if rows <= PACK_ROWS:
        return _kquant_pack(fmt, fields)
    shapes = jax.eval_shape(lambda f: kquant_matmul.pack(fmt, f), fields)
    out = {name: jnp.zeros(shape.shape, shape.dtype) for name, shape in shapes.items()}
    for start in range(0, rows, PACK_ROWS):
        chunk = _kquant_pack(fmt, {name: a[start:start + PACK_ROWS] for name, a in fields.items()})
        first = jnp.int32(start // kquant_matmul.PANEL)  # the chunk's first panel
        out = {name: _put_panels_in_place(out[name], chunk[name], first) for name in out}
        del chunk
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _put_panels_in_place(buffer: jax.Array, chunk: jax.Array, first: jax.Array) -> jax.Array:
    """`buffer` with `chunk` written at panel `first` (axis 0); donates `buffer` (XLA updates it in place)."""
    return jax.lax.dynamic_update_slice_in_dim(buffer, chunk, first, 0)


def vocab_slice(head, start: int, stop: int, *, tied: bool):
    """Vocabulary entries [start, stop) of an LM head in its own format (the same values, nothing dequantized):
    rows of a tied [V, D] embedding (`tied`: dense, or a quantized out_in table), columns of a dense [D, V] head,
    output rows of a quantized head, or whole panels of an unstacked KQuantPanelTensor (then `start` and `stop`
    are multiples of kquant_matmul.PANEL, or `stop` is the vocabulary size)."""
    if isinstance(head, w8a8_reference.FakeQuantWeight):
        return w8a8_reference.FakeQuantWeight(vocab_slice(head.weight, start, stop, tied=tied))
    if isinstance(head, QuantPanelTensor):  # a tied affine table kept once: whole panels of QUANT_PANEL_WIDTH entries
        if head.codes.ndim != 3 or start % QUANT_PANEL_WIDTH or (stop % QUANT_PANEL_WIDTH and stop != head.out_shape[0]):
            raise ValueError(f"a quantized panel head is sliced by whole panels; got [{start}, {stop}) of {head.out_shape}")
        first, last = start // QUANT_PANEL_WIDTH, -(-stop // QUANT_PANEL_WIDTH)
        fields = {name: getattr(head, name)[first:last] for name in ("codes", "scale", "offset") if getattr(head, name) is not None}
        return dataclasses.replace(head, **fields, out_shape=(stop - start,))
    if isinstance(head, KQuantPanelTensor):
        if head.stacked or len(head.parts) != 1 or start % kquant_matmul.PANEL or (stop % kquant_matmul.PANEL and stop != head.out_shape[0]):
            raise ValueError(f"a K-quant head is sliced by whole panels of one part; got [{start}, {stop}) of {head.out_shape}")
        first, last = start // kquant_matmul.PANEL, -(-stop // kquant_matmul.PANEL)
        return dataclasses.replace(head, parts=({name: a[first:last] for name, a in head.parts[0].items()},), out_shape=(stop - start,))
    if isinstance(head, quant.QuantizedTensor):  # every field [O, per_row]
        if head.codes.ndim != 2 or len(head.out_shape) != 1:
            raise ValueError(f"a quantized head is sliced as one [O, ...] matrix; got {head.codes.shape=}, {head.out_shape=}")
        return dataclasses.replace(head, **{name: a[start:stop] for name, a in quant.array_fields(head).items()}, out_shape=(stop - start,))
    return head[start:stop] if tied else head[:, start:stop]  # [V, D] rows, or [D, V] columns
# One fused pass per tensor (about 2x the eager ops' speed on SmolLM2), compiled at load and reused by every
# LLM.update_params (engine/weights.py), which so repacks without compiling.
_to_panels = jax.jit(to_panels, static_argnums=(1, 2))
_head_panels = jax.jit(lambda embed: to_panels(embed.T, 0, 1))


def is_packed(layers: LayerParams) -> bool:
    """Whether any layer matrix is in panels (then the layers scan in place: `scan_in_place`)."""
    return any(isinstance(getattr(layers, f.name), (PanelTensor, QuantPanelTensor, KQuantPanelTensor, MixedQuantStack)) for f in dataclasses.fields(layers))


def layer_in_place(layers: LayerParams, index: Int[Array, ""]) -> LayerParams:
    """Layer `index` of the stack: panel matrices and a MixedQuantStack (layers of several formats) as
    StackedWeight (read in place by `einsum`: a mixed layer dequantized by `lax.switch` over its formats),
    everything else (norms, biases, dense or quantized matrices) sliced as the scan would."""
    def pick(value):
        if isinstance(value, (PanelTensor, QuantPanelTensor, KQuantPanelTensor)):
            return StackedWeight(value, index)
        if isinstance(value, MixedQuantStack):
            return StackedWeight(value, index)
        return None if value is None else jax.tree.map(lambda leaf: leaf[index], value)

    return dataclasses.replace(layers, **{f.name: pick(getattr(layers, f.name)) for f in dataclasses.fields(layers)})


def scan_in_place(body: Callable, carry, layers: LayerParams, layer_index: Int[Array, "N"]):
    """`lax.scan(body, carry, (layers, layer_index))` over the layer index alone: each step hands `body`
    (layer_in_place(layers, i), i), so the panel stacks stay whole. Returns what the scan returns."""
    def body_in_place(carry, index):
        return body(carry, (layer_in_place(layers, index), index))

    return jax.lax.scan(body_in_place, carry, layer_index)
