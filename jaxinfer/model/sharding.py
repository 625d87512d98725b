"""Device layout, in one place: the mesh, logical axis names, the rules that map them onto the mesh,
and the shardings of the params and the KV pool (tensor parallelism inside one model replica).

Every Params field and every KV pool array names its axes with logical names (the `axes` of the
field's entry in the weight table, params.WEIGHTS, and `POOL_AXES`), as jax-llm-examples and MaxText
do. A rules table maps logical names to mesh axes; the mesh has one axis, `model` (tensor parallelism).
`rules_for(cfg, size)` keeps only the rules whose dimension divides the mesh size, so what does not
divide is replicated:

    q_heads  -> model   query heads (wq, bq) and attention's output projection wo on its input side
    kv_heads -> model   kv heads (wk, wv, bk, bv) and the pool's G axis (k, v, k_scale, v_scale)
    mlp      -> model   MLP width (w_gate, w_up) and w_down on its input side
    vocab    -> model   the embedding's rows and the head's columns

wo and w_down are sharded on their contracted (input) side, so each block ends in one all-reduce of
partial sums, which XLA's SPMD partitioner inserts; activations [B, T, D] stay replicated. Nothing in
model.py names a device: jit propagates the layout from the shardings of the params and the pool.

Fallbacks (replicated, never an error):
  * kv heads that do not divide the mesh (SmolLM2: 3 kv heads at TP = 2 or 4; the tiny test Llama: 2
    kv heads at TP = 3 or 4) are replicated, and so is the pool: every device holds every kv head (each
    device writes the same values; the pool's bytes are then per device, not split);
  * query heads are split only together with their kv heads, so each device's query heads read the kv
    heads it holds. Where kv heads are replicated, so are the query heads and wo: a query-sharded,
    kv-replicated layout made XLA all-gather the whole pool every step (seen in the HLO of the tiny
    Llama at TP = 4). Then attention runs replicated and only the MLP and the vocabulary split
    (SmolLM2 at TP = 2 or 4, whose 9 query heads would not divide anyway). A model where nothing
    divides runs replicated (no speed-up).
The block pool and scheduler do not change: pages are logical, every shard holds the same page ids.

Quantized weights (quant.QuantizedTensor, every array field [*lead, O, per_row]): a weight sharded on
its output side splits O (axis -2) of every field; one sharded on its input side (wo, w_down, the tied
embedding used as the head is output side) splits axis -1 of each field whose last axis is a whole
number of the format's blocks per row, only when the blocks per row divide the mesh (so no block is
cut); fields that do not (int8's one scale per row) are replicated. A quantized weight whose logical
axes cannot be matched is replicated whole.
"""

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.model import params as params_lib
from jaxinfer.model import quant
from jaxinfer.config import ModelConfig
from jaxinfer.model.kv_pool import KVPool
from jaxinfer.model.params import Params

MODEL_AXIS = "model"

# KVPool field -> logical axis names (kv_pool.py's layout).
POOL_AXES: dict[str, tuple[str, ...]] = {
    "k": ("layers", "kv_heads", "pages", "head_dim", "page_len"),
    "v": ("layers", "kv_heads", "pages", "page_len", "head_dim"),
    "k_scale": ("layers", "kv_heads", "pages", "page_len"),
    "v_scale": ("layers", "kv_heads", "pages", "page_len"),
}

# Logical axis -> mesh axis, before divisibility is checked (rules_for). Unlisted axes are replicated.
TP_RULES: dict[str, str] = {"q_heads": MODEL_AXIS, "kv_heads": MODEL_AXIS, "mlp": MODEL_AXIS, "vocab": MODEL_AXIS}

# Elements per block of the kept GGUF formats (input elements that one block's bytes cover).
_GGUF_BLOCK = {name: block for name, block, _ in quant.GGUF_KEPT_TYPES.values()}


def rules_for(cfg: ModelConfig, size: int) -> dict[str, str | None]:
    """TP_RULES for a `size`-device model axis: a logical axis whose size does not divide is replicated (None)."""
    sizes = params_lib.axis_sizes(cfg)
    rules = {name: axis if sizes[name] % size == 0 else None for name, axis in TP_RULES.items()}
    if not heads_split(cfg.num_kv_heads, size):  # query heads split only with their kv heads (see the module docstring)
        rules["kv_heads"] = rules["q_heads"] = None
    return rules


def heads_split(num_kv_heads: int, size: int) -> bool:
    """Whether attention heads (kv heads, and query heads with them) split over a `size`-device axis."""
    return num_kv_heads % size == 0


def on_local_heads(kernel, q, k_pages, v_pages, block_tables, lengths, *, k_scales=None, v_scales=None, layer=None):
    """`kernel(q, k_pages, v_pages, block_tables, lengths, k_scales=, v_scales=, layer=)` (a paged decode
    attention call, [B, H, K] out) on each device's own heads: a shard_map over the `model` axis of the
    mesh in context (Engine compiles its programs under `jax.set_mesh`). Query heads, the pool's kv heads
    and their scales are split as the rules split them, so a device's query heads attend to its own kv
    heads; block tables, lengths and the layer index are replicated. Without a mesh of more than one
    device, it is the kernel call itself. Shapes: q [B, H, K]; one layer's pages [G, P, ...] and scales
    [G, P, L], or with `layer` the whole pool [N, G, P, ...] and [N, G, P, L], which each device then
    reads in place (its own shard of every layer)."""
    mesh = jax.sharding.get_abstract_mesh()
    size = 1 if mesh.empty or MODEL_AXIS not in mesh.axis_names else mesh.shape[MODEL_AXIS]
    scales = () if k_scales is None else (k_scales, v_scales)
    extras = dict(zip(("k_scales", "v_scales"), scales)) | ({} if layer is None else {"layer": layer})

    def local(q, k_pages, v_pages, block_tables, lengths, *rest):  # the scales and layer only when given
        return kernel(q, k_pages, v_pages, block_tables, lengths, **dict(zip(extras, rest)))

    if size == 1:
        return local(q, k_pages, v_pages, block_tables, lengths, *extras.values())
    head_axis = k_pages.ndim - 4  # [N?, G, P, K, L]: 1 for a whole pool, 0 for one layer's pages
    heads = MODEL_AXIS if heads_split(k_pages.shape[head_axis], size) else None
    q_spec, rep = PartitionSpec(None, heads, None), PartitionSpec()
    pool_spec = PartitionSpec(*([None] * head_axis), heads)  # the scales [N?, G, P, L] share the head axis
    in_specs = (q_spec, pool_spec, pool_spec, rep, rep) + (pool_spec,) * len(scales) + (rep,) * (layer is not None)
    mapped = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)
    return mapped(q, k_pages, v_pages, block_tables, lengths, *extras.values())


def make_mesh(tensor_parallel: int, devices=None) -> Mesh:
    """A one-axis ('model') mesh over the first `tensor_parallel` devices."""
    devices = jax.devices() if devices is None else list(devices)
    if tensor_parallel > len(devices):
        raise ValueError(f"tensor_parallel={tensor_parallel} needs {tensor_parallel} devices; {len(devices)} available")
    return Mesh(np.asarray(devices[:tensor_parallel]), (MODEL_AXIS,))


def mesh_size(mesh: Mesh) -> int:
    return int(mesh.shape[MODEL_AXIS])


def spec_of(axes: tuple[str, ...], rules: dict[str, str | None]) -> PartitionSpec:
    """Logical axis names -> a PartitionSpec by the rules (unruled axes replicated)."""
    return PartitionSpec(*(rules.get(name) for name in axes))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _quantized_specs(q: quant.QuantizedTensor, axes: tuple[str, ...], rules: dict[str, str | None], size: int) -> quant.QuantizedTensor:
    """PartitionSpecs for every array field of a QuantizedTensor (a pytree of the same structure)."""
    num_lead = q.codes.ndim - 2
    lead, logical = axes[:num_lead], axes[num_lead:]
    num_in = len(q.in_shape)
    in_axes, out_axes = (logical[:num_in], logical[num_in:]) if q.layout == "in_out" else (logical[len(q.out_shape):], logical[: len(q.out_shape)])
    out_mesh = rules.get(out_axes[0]) if out_axes else None  # O = prod(out_shape): split at the first axis's units
    in_mesh = rules.get(in_axes[0]) if in_axes else None
    lead_spec = tuple(rules.get(a) for a in lead)
    if q.format in _GGUF_BLOCK:
        block = _GGUF_BLOCK[q.format]
    elif q.format == "int4":
        block = q.group_size
    else:  # int8: codes one per element, the one scale per row cannot split
        block = 1
    blocks_per_row = math.prod(q.in_shape) // block
    specs = {}
    for name, field in quant.array_fields(q).items():
        last = None
        if in_mesh is not None and blocks_per_row % size == 0 and field.shape[-1] % blocks_per_row == 0:
            last = in_mesh
        specs[name] = PartitionSpec(*lead_spec, out_mesh, last)
    return dataclasses.replace(q, **specs)


def _weight_spec(value, axes: tuple[str, ...], rules: dict[str, str | None], size: int):
    if isinstance(value, quant.QuantizedTensor):
        return _quantized_specs(value, axes, rules, size)
    return spec_of(axes, rules)


def param_specs(params: Params, cfg: ModelConfig, size: int) -> Params:
    """A Params-shaped pytree of PartitionSpecs (QuantizedTensor leaves get one spec per array field),
    from each field's logical axes in the weight table (params.WEIGHTS)."""
    rules = rules_for(cfg, size)
    specs = {name: _weight_spec(value, params_lib.weight_spec(name).axes, rules, size)
             for name, value in params_lib.fields_of(params).items()}
    return params_lib.build(specs)


def _named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_shardings(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    return _named(mesh, param_specs(params, cfg, mesh_size(mesh)))


def pool_shardings(pool: KVPool, cfg: ModelConfig, mesh: Mesh) -> KVPool:
    """The pool sharded over kv heads (replicated when they do not divide the mesh); scales alike."""
    rules = rules_for(cfg, mesh_size(mesh))
    spec = lambda name: NamedSharding(mesh, spec_of(POOL_AXES[name], rules))  # noqa: E731
    return KVPool(spec("k"), spec("v"), spec("k_scale") if pool.quantized else None, spec("v_scale") if pool.quantized else None)


def shard_params(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """Put params on the mesh by the rules.

    A host (numpy) leaf is cut on the host and each device receives only its own slices, so no device
    ever holds a whole split tensor; with several processes (jax.distributed) each process builds the
    shards of its own devices from its own copy of the file, with no cross-process traffic."""
    def put(leaf, sharding):
        if isinstance(leaf, np.ndarray):
            return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])
        return jax.device_put(leaf, sharding)

    return jax.tree.map(put, params, param_shardings(params, cfg, mesh))


def kv_shards(cfg: ModelConfig, size: int) -> int:
    """How many ways the pool's bytes split on a `size`-device mesh (1 when kv heads are replicated)."""
    return size if rules_for(cfg, size)["kv_heads"] else 1
