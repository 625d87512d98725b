"""A GGUF weight's blocks kept as stored, brought onto the device tensor by tensor without ever expanding.

`kept_weight` turns one weight's GGUF tensors (one per layer) into a `quant.QuantizedTensor` stack, or a
`mixed_quant.MixedQuantStack` where the layers mix types (Q4_K_M's attn_v / ffn_down), on the device. Host
memory stays near one layer of one weight beyond what is on the device:

- each layer is split into its fields (`quant.from_gguf`: one host copy of that layer), then written into
  a device buffer preallocated for the whole stack by a jitted update that donates the buffer (XLA updates
  it in place), and the host copy is dropped;
- the file's pages of that tensor are then released from the mapping (`madvise(MADV_DONTNEED)`: the mapping
  is read-only, the file is unchanged), so the touched file does not stay resident beside the device copy.

Imports jax, numpy and the model's quant / mixed_quant; loading.py calls it.
"""

import dataclasses
import mmap
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import panels, quant
from jaxinfer.model.mixed_quant import MixedQuantStack
from jaxinfer.model.panel_tensors import QUANT_PANEL_WIDTH, KQuantPanelTensor, QuantPanelTensor
from kernels_cpu import kquant_matmul

_pack = jax.jit(kquant_matmul.pack, static_argnums=0)  # one layer's panels (jnp; builds nothing)


@jax.jit
def _put_layer(buffer: jax.Array, layer: jax.Array, index: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(buffer, layer, index, 0)


_put_layer_in_place = jax.jit(_put_layer.__wrapped__, donate_argnums=0)  # the stack buffer is updated in place


def release_pages(reader, tensor) -> None:
    """Drop the mapped file pages of `tensor` (a GGUFReader tensor) from this process's resident memory.
    A no-op where the reader holds no mmap (or the platform has no madvise)."""
    mapping = getattr(getattr(reader, "data", None), "_mmap", None)
    if mapping is None or not hasattr(mapping, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = int(tensor.data_offset) // page * page
    stop = int(tensor.data_offset) + int(tensor.n_bytes)
    try:
        mapping.madvise(mmap.MADV_DONTNEED, start, stop - start)
    except (OSError, ValueError):  # a mapping that refuses: the pages stay, nothing else changes
        pass


class _DeviceStack:
    """One format's stack on the device, filled layer by layer in place: the QuantizedTensor fields, or with
    `pack` the K-quant kernel's panels of each layer (kernels_cpu/kquant_matmul.pack, exact)."""

    def __init__(self, first: quant.QuantizedTensor, count: int, pack: bool = False):
        self.pack = pack
        layer = self._layer(first)
        self.template = dataclasses.replace(first, **dict.fromkeys(quant.array_fields(first)))  # metadata only: no host copy kept
        self.buffers = {name: jnp.zeros((count, *field.shape), field.dtype) for name, field in layer.items()}
        self.filled = 0

    def _layer(self, q: quant.QuantizedTensor) -> dict:
        fields = {name: jnp.asarray(field) for name, field in quant.array_fields(q).items()}
        return _pack(q.format, fields) if self.pack else fields

    def add(self, q: quant.QuantizedTensor) -> None:
        for name, field in self._layer(q).items():
            self.buffers[name] = _put_layer_in_place(self.buffers[name], field, jnp.int32(self.filled))
        self.filled += 1

    def tensor(self) -> quant.QuantizedTensor:
        """The stack: the first layer's metadata with the device buffers as its fields."""
        return dataclasses.replace(self.template, **self.buffers)


def packable(types: list[int], num_in: int) -> bool:
    """Whether the K-quant kernel reads every layer of these GGUF types with `num_in` inputs (whole blocks)."""
    formats = [quant.GGUF_KEPT_TYPES[t][0] for t in types]
    return all(f in kquant_matmul.FORMATS and num_in % kquant_matmul.SUPER[f] == 0 for f in formats)


def affine_packable(types: list[int], num_in: int) -> bool:
    """Whether the quantized kernel (kernels_cpu/quant_matmul) reads a matrix of these GGUF types with `num_in`
    inputs: one Q8_0, Q4_0 or Q4_1 type (quant.AFFINE_FORMATS' GGUF ones), whole blocks of 32."""
    formats = {quant.GGUF_KEPT_TYPES[t][0] for t in types}
    return len(formats) == 1 and formats <= {"q8_0", "q4_0", "q4_1"} and num_in % 32 == 0


def kept_weight(read_layer: Callable[[int], quant.QuantizedTensor], types: list[int], *, stacked: bool, pack: bool = False,
                pack_affine: bool = False, release: Callable[[int], None] = lambda i: None,
                ) -> quant.QuantizedTensor | MixedQuantStack | KQuantPanelTensor | QuantPanelTensor:
    """The device form of one weight whose layer i is `read_layer(i)` (host numpy fields) of GGUF type
    `types[i]`: a QuantizedTensor (one type, stacked when `stacked`), else a MixedQuantStack with one stack
    per type in order of first appearance; with `pack` (every type one `packable` says the K-quant kernel
    reads) a KQuantPanelTensor of the same parts, each layer packed as it arrives, so the stored fields and
    the panels never coexist beyond one layer. `pack_affine` (one unstacked matrix, `affine_packable`: a tied Q8_0 /
    Q4_0 / Q4_1 table): a QuantPanelTensor in the quantized kernel's panels, its layout kept (`quant_panels_by_rows`).
    `release(i)` is called once layer i is on the device."""
    if not stacked:
        q = read_layer(0)
        release(0)  # the host copy holds the values now: drop the file's pages first
        if pack_affine:
            return quant_panels_by_rows(q)
        if pack:  # panels.PACK_ROWS output rows at a time into the preallocated panels: an 8B's [128256, 4096] head
            packed = panels.to_kquant_panels(q)  # never has its one-byte codes or a second packed copy whole (GiBs)
            return dataclasses.replace(packed, layout=q.layout)  # "out_in": a tied embedding, kept once for lookup and head
        return _device_put_by_field(q)
    order = list(dict.fromkeys(types))
    layer_part = tuple(order.index(t) for t in types)
    layer_slot = tuple(layer_part[:i].count(part) for i, part in enumerate(layer_part))
    stacks: list[_DeviceStack | None] = [None] * len(order)
    for i, part in enumerate(layer_part):
        q = read_layer(i)
        if stacks[part] is None:
            stacks[part] = _DeviceStack(q, layer_part.count(part), pack=pack)
        release(i)  # the host copy holds the values now: drop the file's pages before the device copy
        stacks[part].add(q)
        del q
    if pack:
        return _kquant_panels(tuple(stacks), layer_part, layer_slot, stacks[0].template, stacked=True)
    parts = tuple(s.tensor() for s in stacks)
    if len(parts) == 1:
        return parts[0]
    return MixedQuantStack(parts=parts, layer_part=layer_part, layer_slot=layer_slot)


_quant_pack = jax.jit(panels.to_quant_panels)


@jax.jit
def _put_panels(buffer: jax.Array, chunk: jax.Array, first: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(buffer, chunk, first, 0)


_put_panels_in_place = jax.jit(_put_panels.__wrapped__, donate_argnums=0)  # the table's buffer is updated in place


def quant_panels_by_rows(q: quant.QuantizedTensor) -> QuantPanelTensor:
    """One unstacked affine matrix (host or device fields, [O, per_row]) packed into the quantized kernel's panels
    (panels.to_quant_panels, exact for Q8_0 / Q4_0 / Q4_1), panels.PACK_ROWS output rows at a time, each chunk written
    in place into the panels preallocated for the whole matrix; `q.layout` is kept ("out_in": a tied embedding, read
    by the lookup and, through panel_tensors.head_view, as the head). A 262k-entry Q8_0 table (Gemma 3) exists so
    once, beside its host copy and one chunk's transients."""
    rows, step = q.codes.shape[0], panels.PACK_ROWS  # a multiple of 2 * QUANT_PANEL_WIDTH: chunks are whole column tiles
    host = quant.array_fields(q)

    def chunk(start: int) -> QuantPanelTensor:
        fields = {name: jnp.asarray(a[start:start + step]) for name, a in host.items()}
        return _quant_pack(dataclasses.replace(q, **fields, out_shape=(min(step, rows - start),), layout="out_in"))

    if rows <= step:
        packed = chunk(0)
    else:
        shapes = jax.eval_shape(panels.to_quant_panels, dataclasses.replace(q, layout="out_in"))
        names = [name for name in ("codes", "scale", "offset") if getattr(shapes, name) is not None]
        out = {name: jnp.zeros(getattr(shapes, name).shape, getattr(shapes, name).dtype) for name in names}
        for start in range(0, rows, step):
            part = chunk(start)
            at = jnp.int32(start // QUANT_PANEL_WIDTH)  # the chunk's first panel
            out = {name: _put_panels_in_place(out[name], getattr(part, name), at) for name in names}
            del part
        packed = dataclasses.replace(shapes, **out)
    return dataclasses.replace(packed, out_shape=q.out_shape, in_shape=q.in_shape, layout=q.layout)


def _device_put_by_field(q: quant.QuantizedTensor) -> quant.QuantizedTensor:
    """`jax.device_put(q)` one field at a time, each host field dropped once on the device: the host and device
    copies coexist for one field, not the whole tensor (a 128k-row embedding table)."""
    host = dict(quant.array_fields(q))
    q = dataclasses.replace(q, **dict.fromkeys(host))
    placed = {}
    for name in list(host):
        placed[name] = jax.device_put(host.pop(name))
        placed[name].block_until_ready()
    return dataclasses.replace(q, **placed)


def _kquant_panels(stacks: tuple[_DeviceStack, ...], layer_part, layer_slot, like: quant.QuantizedTensor, *, stacked: bool) -> KQuantPanelTensor:
    """The packed stacks as one stacked KQuantPanelTensor."""
    return KQuantPanelTensor(parts=tuple(s.buffers for s in stacks), formats=tuple(s.template.format for s in stacks), layer_part=tuple(layer_part),
                             layer_slot=tuple(layer_slot), in_shape=like.in_shape, out_shape=like.out_shape, stacked=stacked)


# ---------------------------------------------------------------- types no kernel reads: converted, never expanded

# Types gguf.quants can write and a CPU kernel reads, by bits per weight: a tensor of a type no kernel reads
# (Q2_K, Q3_K, IQ*, TQ*, MXFP4, ...) becomes the smallest of these with at least its bits per weight.
_CONVERSION_TARGETS = ((4.5, 2), (5.5, 6), (8.5, 8))  # (bits per weight, ggml type id): Q4_0, Q5_0, Q8_0
_noted: set[tuple[str, str]] = set()


def conversion_target(gguf_type: int) -> int | None:
    """The ggml type a tensor of `gguf_type` is converted to when kept, or None when it is kept as it is
    (quant.GGUF_KEPT_TYPES), or is not a quantized matrix type gguf.quants can dequantize (F32, integers)."""
    import gguf  # noqa: PLC0415

    if gguf_type in quant.GGUF_KEPT_TYPES:
        return None
    try:
        kind = gguf.GGMLQuantizationType(gguf_type)
        block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):  # a type this gguf does not know: the dense path names it
        return None
    if block == 1 or kind.name.startswith(("I8", "I16", "I32", "I64", "F64")):
        return None
    bits = 8 * nbytes / block
    return next((target for target_bits, target in _CONVERSION_TARGETS if target_bits >= bits), _CONVERSION_TARGETS[-1][1])


def converted_blocks(data: np.ndarray, gguf_type: int, target: int, name: str) -> np.ndarray:
    """`data` (uint8 rows of blocks of `gguf_type`) as rows of `target` blocks: gguf.quants.dequantize, then
    gguf.quants.quantize (one more rounding: half a step of the target per weight, a full one where the
    quantizer clips a block's edge). One layer's f32
    values exist at a time. Notes each (source, target) pair once per process."""
    import gguf  # noqa: PLC0415

    source, goal = gguf.GGMLQuantizationType(gguf_type), gguf.GGMLQuantizationType(target)
    if (source.name, goal.name) not in _noted:
        _noted.add((source.name, goal.name))
        print(f"jaxinfer: {name} and every other {source.name} tensor is converted to {goal.name} (no CPU kernel reads "
              f"{source.name}; requantized from its dequantized values: an extra rounding of half a {goal.name} step per weight, "
              "a full step where gguf's quantizer clips a block's edge; never expanded to f32)", file=sys.stderr)
    return gguf.quants.quantize(gguf.quants.dequantize(np.asarray(data), source).astype(np.float32), goal)
