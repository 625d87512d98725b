"""Weights swapped in place: `LLM.update_params(params)` for a training loop that samples between updates.

The new params must have the loaded params' tree (`llm.params`: the same fields, the same quantized
formats) and every leaf their shape; a floating leaf of another floating dtype is cast to the engine's,
as the load cast it (`params.cast_model`), anything else must match exactly. The first mismatch raises a
ValueError naming the field. Then each replica's engine gets the arrays placed as its old ones (the
same device, or the same mesh sharding), its step params repacked as at start (`backends.packer`: the
CPU kernels' panels), and its `weight_version` bumped. Nothing else changes: the compiled programs (they
take params as an argument, with the same shapes, dtypes and shardings, so nothing compiles), the
tuner's choice and the KV pool. The prefix cache is dropped, since its pages hold keys and values of the
old weights. Only between streams: a swap while a stream runs is refused.

Owns the check and the swap; imports jax and model/; api.py calls it.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.backends import packer
from jaxinfer.model.params import Params


def _leaves(params) -> dict[str, object]:
    """Field path (".layers.wq", ".embed.codes") -> leaf, in tree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def _check_structure(old: Params, new) -> None:
    if not isinstance(new, Params):
        raise ValueError(f"update_params takes a Params pytree (llm.params' type), got {type(new).__name__}")
    old_leaves, new_leaves = _leaves(old), _leaves(new)
    for name in old_leaves:
        if name not in new_leaves:
            raise ValueError(f"params{name}: missing (llm.params holds it: the same fields and weight formats are needed)")
    for name in new_leaves:
        if name not in old_leaves:
            raise ValueError(f"params{name}: not in the loaded params (a field or format this LLM does not hold)")
    if jax.tree.structure(old) != jax.tree.structure(new):
        raise ValueError("params: the tree differs from the loaded params' (compare jax.tree.structure(llm.params))")


def checked_params(old: Params, new) -> Params:
    """`new` with the loaded params' tree, shapes and dtypes (floating leaves cast to the loaded dtype);
    a ValueError names the first field that differs."""
    _check_structure(old, new)
    old_leaves, new_leaves = _leaves(old), _leaves(new)
    out = []
    for name, old_leaf in old_leaves.items():
        leaf = new_leaves[name]
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            raise ValueError(f"params{name}: must be an array, got {type(leaf).__name__}")
        if tuple(shape) != tuple(old_leaf.shape):
            raise ValueError(f"params{name}: shape {tuple(shape)} differs from the loaded {tuple(old_leaf.shape)}")
        if jnp.dtype(dtype) != old_leaf.dtype:
            if not (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(old_leaf.dtype, jnp.floating)):
                raise ValueError(f"params{name}: dtype {jnp.dtype(dtype)} differs from the loaded {old_leaf.dtype}")
            leaf = leaf.astype(old_leaf.dtype)  # the load's cast (params.cast_model); a host array stays on the host
        out.append(leaf)
    return jax.tree.unflatten(jax.tree.structure(old), out)


def swap_engine_params(engine, params: Params) -> None:
    """Rebind `engine.params` and `engine.step_params` to `params` (checked already), placed as the old
    arrays (their device or mesh sharding), the step params repacked as at start; bump its weight_version."""
    placed = jax.tree.map(_place, params, engine.params)
    pack = packer(engine.matmul_impl)
    engine.params, engine.step_params = placed, placed if pack is None else pack(placed)
    engine.weight_version += 1


def _place(leaf, old: jax.Array) -> jax.Array:
    """A leaf placed as the old one. On a mesh (committed arrays) a host array is cut on the host, each device
    (of this process, under jax.distributed) getting its own slice, as sharding.shard_params places a loaded
    model. One device: a loaded model's arrays are uncommitted, and so stay the new ones (an uncommitted
    array is kept, a committed one copied through the host), since the eager ops that repack the CPU
    kernels' panels compile again for committed inputs. (`_committed` is private jax.Array state.)"""
    if getattr(old, "_committed", True):
        if isinstance(leaf, np.ndarray):
            return jax.make_array_from_callback(leaf.shape, old.sharding, lambda index: leaf[index])
        return jax.device_put(leaf, old.sharding)
    if isinstance(leaf, jax.Array) and not leaf._committed:
        return leaf
    return jax.device_put(np.asarray(leaf))


def update_llm(llm, params: Params) -> int:
    """LLM.update_params: check `params` once, swap every replica's engine, drop the prefix cache; the new
    weight_version. Refused while a stream runs (its pages hold the old weights' keys and values)."""
    if not llm._running.acquire(blocking=False):
        raise RuntimeError("update_params: this LLM is generating (finish or close() the stream first)")
    try:
        checked = checked_params(llm.params, params)
        for replica in llm.replicas:
            swap_engine_params(replica.engine, checked)
        llm.reset_prefix_cache()
    finally:
        llm._running.release()
    return llm.weight_version

