"""A stacked weight whose layers are stored in more than one quantized format, kept as stored.

llama.cpp's mixed files (Q4_K_M, Q5_K_M) give some layers of one weight a wider type: `attn_v` and
`ffn_down` are Q6_K in the first and last eighth of the layers and every third layer between, Q4_K (or
Q5_K) elsewhere. `MixedQuantStack` keeps each layer in its own format: one `quant.QuantizedTensor` stack
per format (`parts`, layers in file order) and a static table naming, for every layer, its part and its
index in that part. Nothing is expanded or requantized. Readers pick a layer by a traced index with
`lax.switch` over the parts (`layer_dense`; the CPU kernel's panels in panels.py do the same).

Imports jax, numpy and quant only (params.py and panels.py import this module).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxinfer.model import quant


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedQuantStack:
    """Layers [N, *logical] of one weight, layer i stored in `parts[layer_part[i]]` at `layer_slot[i]`.

    Every part is a QuantizedTensor stack `[n_k, O, per_row]` of one format, with the same logical
    in/out shape and layout; sum(n_k) = N."""

    parts: tuple[quant.QuantizedTensor, ...]
    layer_part: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    layer_slot: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        if len(self.layer_part) != len(self.layer_slot) or not self.parts:
            raise ValueError(f"a MixedQuantStack needs parts and one (part, slot) per layer; got {len(self.parts)} parts, "
                             f"{len(self.layer_part)} / {len(self.layer_slot)} table entries")

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(part.format for part in self.parts)

    @property
    def format(self) -> str:
        """The formats joined with '+', e.g. 'q4_k+q6_k' (what `jaxinfer info` and weight_bytes report)."""
        return "+".join(self.formats)

    @property
    def num_layers(self) -> int:
        return len(self.layer_part)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers,) + self.parts[0].shape[1:]

    @property
    def in_shape(self) -> tuple[int, ...]:
        return self.parts[0].in_shape

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.parts[0].out_shape


def stack_layers(per_layer: list[quant.QuantizedTensor]) -> quant.QuantizedTensor | MixedQuantStack:
    """Per-layer QuantizedTensors (host numpy leaves) -> one stack if they share a format, else a
    MixedQuantStack with one stack per format (formats in order of first appearance)."""
    formats = list(dict.fromkeys(q.format for q in per_layer))
    if len(formats) == 1:
        return quant.stack(per_layer)
    layer_part = tuple(formats.index(q.format) for q in per_layer)
    layer_slot = tuple(layer_part[:i].count(part) for i, part in enumerate(layer_part))
    parts = tuple(quant.stack([q for q, p in zip(per_layer, layer_part) if p == k]) for k in range(len(formats)))
    return MixedQuantStack(parts=parts, layer_part=layer_part, layer_slot=layer_slot)


def layer_order(m: MixedQuantStack) -> np.ndarray:
    """i32[N]: layer i's row in the concatenation of the parts."""
    starts = np.cumsum([0] + [part.codes.shape[0] for part in m.parts])[:-1]
    return np.array([starts[p] + s for p, s in zip(m.layer_part, m.layer_slot)], np.int32)


def dequantize(m: MixedQuantStack, dtype=jnp.float32) -> Float[Array, "N ..."]:
    """The dense stack [N, *logical] (quant.dequantize of each part, layers back in order)."""
    dense = jnp.concatenate([quant.dequantize(part, dtype) for part in m.parts], axis=0)
    return dense[jnp.asarray(layer_order(m))]


def layer_dense(m: MixedQuantStack, index: Int[Array, ""], dtype=jnp.float32) -> Float[Array, "..."]:
    """Layer `index` (traced) dense in its logical shape: `lax.switch` over the parts, each dequantizing
    its own slot of that layer (one layer of one format at a time, as qeinsum dequantizes in the scan)."""
    part_of = jnp.asarray(np.array(m.layer_part, np.int32))[index]
    slot_of = jnp.asarray(np.array(m.layer_slot, np.int32))[index]

    def branch(part: quant.QuantizedTensor):
        def run(slot):
            return quant.dequantize(jax.tree.map(lambda leaf: jnp.asarray(leaf)[slot], part), dtype)
        return run

    return jax.lax.switch(part_of, [branch(part) for part in m.parts], slot_of)


def is_mixed(value) -> bool:
    return isinstance(value, MixedQuantStack)


def nbytes(m: MixedQuantStack) -> int:
    """Bytes of every part's fields."""
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(m))
