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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import quant
from jaxinfer.model.mixed_quant import MixedQuantStack


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
    """One format's stack of QuantizedTensor fields on the device, filled layer by layer in place."""

    def __init__(self, first: quant.QuantizedTensor, count: int):
        self.template = first
        self.buffers = {name: jnp.zeros((count, *np.shape(field)), np.asarray(field).dtype) for name, field in quant.array_fields(first).items()}
        self.filled = 0

    def add(self, q: quant.QuantizedTensor) -> None:
        for name, field in quant.array_fields(q).items():
            self.buffers[name] = _put_layer_in_place(self.buffers[name], jnp.asarray(field), jnp.int32(self.filled))
        self.filled += 1

    def tensor(self) -> quant.QuantizedTensor:
        """The stack: the first layer's metadata with the device buffers as its fields."""
        return dataclasses.replace(self.template, **self.buffers)


def kept_weight(read_layer: Callable[[int], quant.QuantizedTensor], types: list[int], *, stacked: bool,
                release: Callable[[int], None] = lambda i: None) -> quant.QuantizedTensor | MixedQuantStack:
    """The device form of one weight whose layer i is `read_layer(i)` (host numpy fields) of GGUF type
    `types[i]`: a QuantizedTensor (one type, stacked when `stacked`), else a MixedQuantStack with one stack
    per type in order of first appearance. `release(i)` is called once layer i is on the device."""
    if not stacked:
        q = jax.device_put(read_layer(0))
        release(0)
        return q
    order = list(dict.fromkeys(types))
    layer_part = tuple(order.index(t) for t in types)
    layer_slot = tuple(layer_part[:i].count(part) for i, part in enumerate(layer_part))
    stacks: list[_DeviceStack | None] = [None] * len(order)
    for i, part in enumerate(layer_part):
        q = read_layer(i)
        if stacks[part] is None:
            stacks[part] = _DeviceStack(q, layer_part.count(part))
        stacks[part].add(q)
        del q
        release(i)
    parts = tuple(s.tensor() for s in stacks)
    if len(parts) == 1:
        return parts[0]
    return MixedQuantStack(parts=parts, layer_part=layer_part, layer_slot=layer_slot)
