"""Params pytrees and the ONE weight-spec table (`WEIGHTS`) they are built from.

Each Params field has one `WeightSpec` entry: its logical axes (its shape is their sizes under the config,
`axis_sizes`; a leading "layers" axis stacks it per layer for `lax.scan`), its contracted axes if it is a
matmul weight, its kind, its Hugging Face and GGUF tensor names, the transform from the file's layout and
the config condition under which it exists. The pytree classes `LayerParams` and `Params` are built from the
table (`params_classes`), and every reader (model.py, sharding.py, loading.py, `jaxinfer info`) takes what
it needs from the entries: adding a weight is one edit here. Functions take the table as an argument with
`WEIGHTS` as the default, and a Params value carries its table (`Params.specs`), so a test can run a copy.

Weights are stored in the layout the einsums in model.py consume, so no transposes happen inside the step.
Q/K projections are in Hugging Face's rotary layout (rotate-half pairs (i, i + K/2)); the GGUF loader undoes
llama.cpp's permutation (the entries marked `gguf_rotary`).

A matmul weight may instead be a `quant.QuantizedTensor` of the same logical shape (model.py's qeinsum and
take accept both). `weight_format` is the one owner of which tensors are quantized, and to what;
`quantize_arrays` applies it for int8/int4, loading.py for GGUF's own blocks.
"""

import dataclasses
import functools
import math
import operator
import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.options import DEFAULT_INT4_GROUP_SIZE
from jaxinfer.model import quant
from jaxinfer.config import ModelConfig

KINDS = ("embedding", "attention", "mlp", "head")  # the tensor kinds `jaxinfer info` reports
Weight = jax.Array | quant.QuantizedTensor


# Logical axis -> (model.py's axis letter, the ModelConfig field that sizes it).
AXES = {
    "layers": ("N", "num_layers"),
    "embed": ("D", "embed_dim"),
    "q_heads": ("H", "num_heads"),
    "kv_heads": ("G", "num_kv_heads"),
    "head_dim": ("K", "head_dim"),
    "mlp": ("F", "ffn_dim"),
    "vocab": ("V", "vocab_size"),
}


def axis_sizes(cfg: ModelConfig) -> dict[str, int]:
    """Logical axis name -> its size under `cfg`."""
    return {name: getattr(cfg, field) for name, (_, field) in AXES.items()}


def transposed(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A file matrix [out, in] (HF's and, dequantized, GGUF's) -> [*in, *out] of `shape`."""
    return w.T.reshape(shape)


def reshaped(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A file tensor already in the Params order (vectors, the [V, D] embedding) -> `shape`."""
    return w.reshape(shape)


def always(cfg: ModelConfig) -> bool:
    return True


def untied(cfg: ModelConfig) -> bool:
    return not cfg.tie_embeddings


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """Everything about one Params field (after jax-llm-examples' ArrayInfo)."""

    name: str  # the Params field (a LayerParams field when stacked)
    axes: tuple[str, ...]  # logical axes of the Params layout; "layers" first = stacked per layer
    kind: str  # one of KINDS
    hf: str  # Hugging Face tensor name; "{i}" is the layer index
    gguf: str  # GGUF tensor name; "{i}" is the layer index
    num_in: int = 0  # matmul weights: how many axes are contracted (0: not a matmul weight)
    layout: str = "in_out"  # where the contracted axes are (after "layers"): first, or last ("out_in")
    from_file: Callable[[np.ndarray, tuple[int, ...]], np.ndarray] = reshaped  # one file tensor -> one layer's shape
    present: Callable[[ModelConfig], bool] = always  # whether a config has this weight
    init: str = "normal"  # init_random: "normal" (scaled) or "ones" (norms)
    gguf_rotary: bool = False  # llama.cpp permutes its rows (architecture "llama"), per head of out_axes[0]

    def __post_init__(self):
        unknown = [a for a in self.axes if a not in AXES]
        if unknown or self.kind not in KINDS or self.layout not in ("in_out", "out_in") or self.init not in ("normal", "ones"):
            raise ValueError(f"weight {self.name!r}: axes must be of {tuple(AXES)} (unknown: {unknown}), kind one of {KINDS}, "
                             f"layout 'in_out' or 'out_in', init 'normal' or 'ones'; got {self}")
        if "layers" in self.axes[1:] or not 0 <= self.num_in < len(self.axes) - (self.axes[0] == "layers"):
            raise ValueError(f"weight {self.name!r}: 'layers' may only lead, and num_in must leave an output axis; got {self}")

    @property
    def stacked(self) -> bool:
        return self.axes[0] == "layers"

    @property
    def in_axes(self) -> tuple[str, ...]:
        """Logical axes of one layer that a matmul contracts."""
        axes = self.axes[1:] if self.stacked else self.axes
        return axes[len(axes) - self.num_in :] if self.layout == "out_in" else axes[: self.num_in]

    @property
    def out_axes(self) -> tuple[str, ...]:
        """Logical axes of one layer that a matmul keeps (output channels)."""
        axes = self.axes[1:] if self.stacked else self.axes
        return axes[: len(axes) - self.num_in] if self.layout == "out_in" else axes[self.num_in :]

    def shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        sizes = axis_sizes(cfg)
        return tuple(sizes[a] for a in self.axes)

    def layer_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The shape of one layer's slice (the whole shape when not stacked)."""
        return self.shape(cfg)[1:] if self.stacked else self.shape(cfg)

    def file_names(self, cfg: ModelConfig, fmt: str) -> list[str]:
        """The tensor names in a file of `fmt` ("hf" or "gguf"), one per layer when stacked."""
        name = self.hf if fmt == "hf" else self.gguf
        return [name.format(i=i) for i in range(cfg.num_layers)] if self.stacked else [name]


_L = "model.layers.{i}."
_with_bias = operator.attrgetter("attention_bias")
_with_qk_norm = operator.attrgetter("qk_norm")

WEIGHTS: tuple[WeightSpec, ...] = (
    WeightSpec("embed", ("vocab", "embed"), "embedding", "model.embed_tokens.weight", "token_embd.weight", num_in=1, layout="out_in"),
    WeightSpec("attn_norm", ("layers", "embed"), "attention", _L + "input_layernorm.weight", "blk.{i}.attn_norm.weight", init="ones"),
    WeightSpec("wq", ("layers", "embed", "q_heads", "head_dim"), "attention", _L + "self_attn.q_proj.weight", "blk.{i}.attn_q.weight",
               num_in=1, from_file=transposed, gguf_rotary=True),
    WeightSpec("wk", ("layers", "embed", "kv_heads", "head_dim"), "attention", _L + "self_attn.k_proj.weight", "blk.{i}.attn_k.weight",
               num_in=1, from_file=transposed, gguf_rotary=True),
    WeightSpec("wv", ("layers", "embed", "kv_heads", "head_dim"), "attention", _L + "self_attn.v_proj.weight", "blk.{i}.attn_v.weight",
               num_in=1, from_file=transposed),
    WeightSpec("wo", ("layers", "q_heads", "head_dim", "embed"), "attention", _L + "self_attn.o_proj.weight", "blk.{i}.attn_output.weight",
               num_in=2, from_file=transposed),
    WeightSpec("mlp_norm", ("layers", "embed"), "mlp", _L + "post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight", init="ones"),
    WeightSpec("w_gate", ("layers", "embed", "mlp"), "mlp", _L + "mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", num_in=1, from_file=transposed),
    WeightSpec("w_up", ("layers", "embed", "mlp"), "mlp", _L + "mlp.up_proj.weight", "blk.{i}.ffn_up.weight", num_in=1, from_file=transposed),
    WeightSpec("w_down", ("layers", "mlp", "embed"), "mlp", _L + "mlp.down_proj.weight", "blk.{i}.ffn_down.weight", num_in=1, from_file=transposed),
    WeightSpec("bq", ("layers", "q_heads", "head_dim"), "attention", _L + "self_attn.q_proj.bias", "blk.{i}.attn_q.bias", present=_with_bias),
    WeightSpec("bk", ("layers", "kv_heads", "head_dim"), "attention", _L + "self_attn.k_proj.bias", "blk.{i}.attn_k.bias", present=_with_bias),
    WeightSpec("bv", ("layers", "kv_heads", "head_dim"), "attention", _L + "self_attn.v_proj.bias", "blk.{i}.attn_v.bias", present=_with_bias),
    WeightSpec("q_norm", ("layers", "head_dim"), "attention", _L + "self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight",
               present=_with_qk_norm, init="ones"),
    WeightSpec("k_norm", ("layers", "head_dim"), "attention", _L + "self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight",
               present=_with_qk_norm, init="ones"),
    WeightSpec("final_norm", ("embed",), "head", "model.norm.weight", "output_norm.weight", init="ones"),
    WeightSpec("lm_head", ("embed", "vocab"), "head", "lm_head.weight", "output.weight", num_in=1, from_file=transposed, present=untied),
)
Table = tuple[WeightSpec, ...]


def _pytree_class(name: str, field_names: list[str], table: Table, doc: str) -> type:
    """A frozen dataclass registered as a pytree; every field defaults to None (a weight the config lacks)."""
    fields = [(n, typing.Any, dataclasses.field(default=None)) for n in field_names]
    cls = dataclasses.make_dataclass(name, fields, frozen=True, namespace={"specs": table, "__doc__": doc}, module=__name__)
    return jax.tree_util.register_dataclass(cls)


def _fields_doc(specs: list[WeightSpec]) -> str:
    """One line per field with its shape in model.py's axis letters, e.g. `wq: [N, D, H, K]`."""
    def line(s: WeightSpec) -> str:
        optional = "" if s.present is always else " (None unless the config has it)"
        return f"{s.name}: [{', '.join(AXES[a][0] for a in s.axes)}]{optional}"

    return "\n".join(line(s) for s in specs)


@functools.cache
def params_classes(table: Table = WEIGHTS) -> tuple[type, type]:
    """(LayerParams, Params) for `table`: one field per entry, the stacked ones in LayerParams, and
    Params's `layers` where the first stacked entry stands. Both carry the table as `specs`."""
    names = [s.name for s in table]
    if len(set(names)) != len(names):
        raise ValueError(f"weight names repeat in the table: {names}")
    stacked = [s for s in table if s.stacked]
    layer_cls = _pytree_class("LayerParams", [s.name for s in stacked], table,
                              "Weights of all layers, stacked: the leading axis is the layer index (N).\n\n" + _fields_doc(stacked))
    top = [s.name for s in table if not s.stacked]
    top.insert(next((i for i, s in enumerate(table) if s.stacked), len(top)), "layers")  # where the first stacked entry stands
    params_cls = _pytree_class("Params", top, table, "The model's weights (`layers`: LayerParams).\n\n" + _fields_doc([s for s in table if not s.stacked]))
    return layer_cls, params_cls


LayerParams, Params = params_classes(WEIGHTS)


def weight_spec(name: str, table: Table = WEIGHTS) -> WeightSpec:
    for spec in table:
        if spec.name == name:
            return spec
    raise KeyError(f"no weight {name!r} in the table")


def present(cfg: ModelConfig, table: Table = WEIGHTS) -> Table:
    """The entries this config has (biases and q/k norms only with their feature, the head only untied)."""
    return tuple(spec for spec in table if spec.present(cfg))


def build(values: dict[str, object], table: Table = WEIGHTS) -> Params:
    """Params of `table` from values keyed by field name (a missing field is None)."""
    layer_cls, params_cls = params_classes(table)
    layers = layer_cls(**{s.name: values.get(s.name) for s in table if s.stacked})
    return params_cls(layers=layers, **{s.name: values.get(s.name) for s in table if not s.stacked})


def fields_of(params) -> dict[str, object]:
    """Field name -> value of every weight the params hold (layer fields stacked), in table order."""
    out = {}
    for spec in params.specs:
        value = getattr(params.layers if spec.stacked else params, spec.name)
        if value is not None:
            out[spec.name] = value
    return out


def num_params(cfg: ModelConfig, table: Table = WEIGHTS) -> int:
    """Parameter count: the elements of every weight the config has (a tied head counted once)."""
    return sum(math.prod(spec.shape(cfg)) for spec in present(cfg, table))


def abstract(cfg: ModelConfig, table: Table = WEIGHTS) -> Params:
    """Params of jax.ShapeDtypeStruct leaves (dense, cfg.dtype): shapes without allocating."""
    dtype = jnp.dtype(cfg.dtype)
    return build({s.name: jax.ShapeDtypeStruct(s.shape(cfg), dtype) for s in present(cfg, table)}, table)


def weight_format(field: str, quantization: str | None, table: Table = WEIGHTS) -> str | None:
    """What `field` is stored as under `quantization`: None (dense, cfg.dtype), "gguf" (the file's
    blocks, where their type is kept), "int8" or "int4". The one owner of this choice.

    Norms and biases stay dense (tiny, and added rather than multiplied). The embedding and the head are
    int8 under both int8 and int4: the head's error lands on the logits unnormalized, and an int8 row per
    vocabulary entry keeps the tied [V, D] table at a quarter of f32 (SmolLM2: 28 of 135M parameters) with a
    per-row scale that serves both the lookup and the head. Under gguf they keep the file's own type.
    """
    spec = weight_spec(field, table)
    if quantization is None or not spec.num_in:
        return None
    if quantization == "int4" and spec.kind in ("embedding", "head"):
        return "int8"
    return quantization


def _matmul_rows(spec: WeightSpec, w: np.ndarray) -> tuple[np.ndarray, dict]:
    """A weight in its Params layout -> [*lead, O, I] rows plus its logical factoring for QuantizedTensor."""
    if spec.layout == "out_in":  # [V, D] is already rows of output channels
        return w, dict(layout="out_in")
    lead = 1 if spec.stacked else 0
    in_shape, out_shape = w.shape[lead : lead + spec.num_in], w.shape[lead + spec.num_in :]
    rows = w.reshape(*w.shape[:lead], int(np.prod(in_shape)), int(np.prod(out_shape)))
    return np.swapaxes(rows, -1, -2), dict(in_shape=tuple(in_shape), out_shape=tuple(out_shape), layout="in_out")


def quantize_arrays(arrays: dict[str, object], quantization: str, *, group_size: int = DEFAULT_INT4_GROUP_SIZE,
                    table: Table = WEIGHTS) -> dict[str, object]:
    """int8 / int4: replace each host f32 matmul weight (Params layout) chosen by `weight_format` with a
    QuantizedTensor; everything else passes through. An int4 group that does not divide a weight's
    input width is a ValueError naming the weight."""
    out = dict(arrays)
    for field, w in arrays.items():
        fmt = weight_format(field, quantization, table)
        if fmt not in ("int8", "int4") or isinstance(w, quant.QuantizedTensor):
            continue
        rows, logical = _matmul_rows(weight_spec(field, table), np.asarray(w, np.float32))
        try:
            out[field] = quant.quantize_int8(rows, **logical) if fmt == "int8" else quant.quantize_int4(rows, group_size=group_size, **logical)
        except ValueError as e:
            raise ValueError(f"cannot quantize weight {field!r} {tuple(w.shape)} to int4 with group size {group_size}: {e}") from None
    return out


def _to_device(value, dtype) -> Weight:
    if isinstance(value, quant.QuantizedTensor):
        return jax.device_put(value)
    return jnp.asarray(value, dtype=dtype)


def _to_host(value, dtype) -> Weight:
    """The weight as host (numpy) leaves, dense ones cast to `dtype` (the same rounding as on a device)."""
    if isinstance(value, quant.QuantizedTensor):
        return jax.device_get(value)
    return np.asarray(jax.device_get(value)).astype(dtype, copy=False)


def weight_bytes(params: Params) -> dict[tuple[str, str], int]:
    """Resident device bytes per (tensor kind, storage format), e.g. ("attention", "q4_1"); formats are
    a QuantizedTensor's `format` or a dense array's dtype name. Measured with quant.resident_bytes."""
    totals: dict[tuple[str, str], int] = {}
    for field, value in fields_of(params).items():
        fmt = value.format if isinstance(value, quant.QuantizedTensor) else jnp.dtype(value.dtype).name
        key = (weight_spec(field, params.specs).kind, fmt)
        totals[key] = totals.get(key, 0) + quant.resident_bytes(value)
    return totals


def from_numpy(cfg: ModelConfig, arrays: dict[str, object], *, on_host: bool = False, table: Table = WEIGHTS) -> Params:
    """Build Params from host arrays keyed by field name (every entry of `table` the config has), checking
    every shape and casting dense ones to `cfg.dtype`. A value may be a QuantizedTensor (host or device
    leaves) of the expected logical shape; it is put on the device as is.
    `on_host`: keep every leaf in host memory (numpy), for sharding.shard_params to place shard by shard."""
    dtype = jnp.dtype(cfg.dtype)
    for spec in present(cfg, table):
        shape = spec.shape(cfg)
        if spec.name not in arrays:
            raise ValueError(f"missing weight {spec.name!r}")
        if tuple(arrays[spec.name].shape) != shape:
            raise ValueError(f"weight {spec.name!r} has shape {tuple(arrays[spec.name].shape)}, expected {shape}")
    place = _to_host if on_host else _to_device
    return build({spec.name: place(arrays[spec.name], dtype) for spec in present(cfg, table)}, table)


def init_random(key: jax.Array, cfg: ModelConfig, scale: float = 0.02, *, table: Table = WEIGHTS) -> Params:
    """Random weights of the given geometry (benchmarks and tests of shapes, never numerics claims)."""
    specs = sorted(present(cfg, table), key=lambda s: not s.stacked)  # layer weights first, as seeds always drew them
    keys = jax.random.split(key, len(specs))
    arrays = {}
    for sub, spec in zip(keys, specs):
        shape = spec.shape(cfg)
        arrays[spec.name] = np.ones(shape, np.float32) if spec.init == "ones" else np.asarray(jax.random.normal(sub, shape) * scale)
    return from_numpy(cfg, arrays, table=table)
