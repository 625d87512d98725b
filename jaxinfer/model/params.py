"""Params pytrees (`Params`, `LayerParams`: declared, typed) and the ONE weight-spec table (`WEIGHTS`).

Each Params field has one `WeightSpec` entry: its logical axes (its shape is their sizes under the config,
`axis_sizes`; a leading "layers" axis stacks it per layer for `lax.scan`), its contracted axes if it is a
matmul weight, its kind, its Hugging Face and GGUF tensor names, the transform from the file's layout and
the config condition under which it exists. Every reader (forward.py, sharding.py, loading.py, `jaxinfer
info`) takes what it needs from the entries. Adding a weight is two edits here: its entry and its field
(tests/model/test_weight_spec.py checks that the fields equal the table's names).

Weights are stored in the layout the einsums in forward.py consume, so no transposes happen inside the step.
Q/K projections are in Hugging Face's rotary layout (rotate-half pairs (i, i + K/2)); the GGUF loader undoes
llama.cpp's permutation (the entries marked `gguf_rotary`).

A matmul weight may instead be a `quant.QuantizedTensor` of the same logical shape (forward.py's qeinsum and
take accept both). `weight_format` is the one owner of which tensors are quantized, and to what;
`quantize_arrays` applies it for int8/int4, loading.py for GGUF's own blocks. Imports jax, numpy, config,
options and quant; never scheduling/ or engine/ (panels.py imports this module, so its types are named
only for type checkers).
"""
import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxinfer.config import DEFAULT_INT4_GROUP_SIZE
from jaxinfer.model import mixed_quant, quant
from jaxinfer.model.mixed_quant import MixedQuantStack
from jaxinfer.model.panel_tensors import KQuantPanelTensor, PanelTensor, QuantPanelTensor, StackedWeight, kquant_dense_stack, quant_dense
from jaxinfer.config import ModelConfig

KINDS = ("embedding", "attention", "mlp", "head")  # the tensor kinds `jaxinfer info` reports

# What one weight field holds: a dense array (on a device, or numpy while on the host), a quantized tensor,
# or, in the engine's step params for the CPU kernels, panels (panel_tensors.py; a StackedWeight inside the layer scan).
WeightValue = Union[jax.Array, np.ndarray, quant.QuantizedTensor, MixedQuantStack, PanelTensor, QuantPanelTensor, KQuantPanelTensor, StackedWeight]
# The same classes also describe weights without holding them: `abstract` fills them with shapes,
# sharding.param_specs with each weight's PartitionSpec.
WeightInfo = Union[jax.ShapeDtypeStruct, PartitionSpec]
Weight = Union[WeightValue, WeightInfo]


# Logical axis -> (forward.py's axis letter, the ModelConfig field that sizes it).
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


def broadcast(w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A file scalar (Gemma 4's per-layer `layer_scalar`, shape [1]) -> `shape`, every element that scalar."""
    if w.size != 1:
        raise ValueError(f"expected one value, got shape {w.shape}")
    return np.full(shape, w.reshape(()), w.dtype)


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
    hf_post_norms: str = ""  # the HF name instead, in families with post norms (Gemma: the MLP's pre-norm is pre_feedforward_layernorm)

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
        if fmt == "hf" and self.hf_post_norms and cfg.post_norms:
            name = self.hf_post_norms
        return [name.format(i=i) for i in range(cfg.num_layers)] if self.stacked else [name]


_L = "model.layers.{i}."
_with_bias = operator.attrgetter("attention_bias")
_with_qk_norm = operator.attrgetter("qk_norm")
_with_post_norms = operator.attrgetter("post_norms")
_with_layer_scale = operator.attrgetter("layer_scale")

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
    WeightSpec("mlp_norm", ("layers", "embed"), "mlp", _L + "post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight", init="ones",
               hf_post_norms=_L + "pre_feedforward_layernorm.weight"),
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
    WeightSpec("post_attn_norm", ("layers", "embed"), "attention", _L + "post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight",
               present=_with_post_norms, init="ones"),
    WeightSpec("post_mlp_norm", ("layers", "embed"), "mlp", _L + "post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight",
               present=_with_post_norms, init="ones"),
    WeightSpec("layer_scale", ("layers", "embed"), "mlp", _L + "layer_scalar", "blk.{i}.layer_output_scale.weight",
               from_file=broadcast, present=_with_layer_scale, init="ones"),
    WeightSpec("final_norm", ("embed",), "head", "model.norm.weight", "output_norm.weight", init="ones"),
    WeightSpec("lm_head", ("embed", "vocab"), "head", "lm_head.weight", "output.weight", num_in=1, from_file=transposed, present=untied),
)


@dataclasses.dataclass(frozen=True)
class FusedSpec:
    """One file tensor holding several WEIGHTS entries' [out, in] rows back to back (Phi-3's qkv_proj and
    gate_up_proj; llama.cpp's attn_qkv, and ffn_up holding gate then up). The loaders split it into the
    entries' own tensors, so the Params and the forward never see it."""

    hf: str  # Hugging Face tensor name; "{i}" is the layer index
    gguf: str  # GGUF tensor name
    parts: tuple[str, ...]  # the WEIGHTS entries whose rows it holds, in order

    def rows(self, cfg: ModelConfig) -> list[int]:
        """Output rows of each part under `cfg`."""
        sizes = axis_sizes(cfg)
        return [math.prod(sizes[a] for a in weight_spec(part).out_axes) for part in self.parts]

    def in_file(self, names, i: int, fmt: str) -> str | None:
        """Layer i's fused tensor name ("hf" or "gguf") where the file holds it in place of some part's own
        tensor, else None (a GGUF ffn_up is the plain up projection beside an ffn_gate)."""
        name = (self.hf if fmt == "hf" else self.gguf).format(i=i)
        own = [getattr(weight_spec(part), fmt).format(i=i) for part in self.parts]
        return name if name in names and any(n not in names for n in own if n != name) else None

    def split(self, w: np.ndarray, cfg: ModelConfig) -> list[np.ndarray]:
        """The fused [sum of rows, in] tensor -> each part's [rows, in]."""
        rows = self.rows(cfg)
        if w.ndim != 2 or w.shape[0] != sum(rows):
            raise ValueError(f"fused tensor of shape {w.shape} cannot hold {' + '.join(map(str, rows))} rows of {', '.join(self.parts)}")
        return np.split(w, np.cumsum(rows)[:-1], axis=0)


FUSED: tuple[FusedSpec, ...] = (
    FusedSpec(_L + "self_attn.qkv_proj.weight", "blk.{i}.attn_qkv.weight", ("wq", "wk", "wv")),
    FusedSpec(_L + "mlp.gate_up_proj.weight", "blk.{i}.ffn_up.weight", ("w_gate", "w_up")),
)


def unfuse(hf: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The fused tensors of a Hugging Face checkpoint (HF names -> [out, in]) split into their parts' names."""
    out = {}
    for fused in FUSED:
        for i in range(cfg.num_layers):
            if (name := fused.in_file(hf, i, "hf")) is not None:
                out.update(zip((weight_spec(p).hf.format(i=i) for p in fused.parts), fused.split(hf[name], cfg)))
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """Weights of all layers, stacked: the leading axis is the layer index (N). Inside the layer scan a
    value holds one layer (the shape without N). One field per stacked WEIGHTS entry, in table order;
    the optional ones (default None) are the entries with a `present` condition."""

    attn_norm: Weight  # [N, D]
    wq: Weight  # [N, D, H, K]
    wk: Weight  # [N, D, G, K]
    wv: Weight  # [N, D, G, K]
    wo: Weight  # [N, H, K, D]
    mlp_norm: Weight  # [N, D]
    w_gate: Weight  # [N, D, F]
    w_up: Weight  # [N, D, F]
    w_down: Weight  # [N, F, D]
    bq: Weight | None = None  # [N, H, K]; only with cfg.attention_bias
    bk: Weight | None = None  # [N, G, K]; only with cfg.attention_bias
    bv: Weight | None = None  # [N, G, K]; only with cfg.attention_bias
    q_norm: Weight | None = None  # [N, K]; only with cfg.qk_norm
    k_norm: Weight | None = None  # [N, K]; only with cfg.qk_norm
    post_attn_norm: Weight | None = None  # [N, D]; only with cfg.post_norms
    post_mlp_norm: Weight | None = None  # [N, D]; only with cfg.post_norms
    layer_scale: Weight | None = None  # [N, D], one scalar per layer broadcast over D; only with cfg.layer_scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    """The model's weights: the unstacked WEIGHTS entries, and `layers` where the first stacked entry stands."""

    embed: Weight  # [V, D]
    layers: LayerParams
    final_norm: Weight  # [D]
    lm_head: Weight | None = None  # [D, V]; None when tied to the embedding (cfg.tie_embeddings)


def weight_spec(name: str) -> WeightSpec:
    for spec in WEIGHTS:
        if spec.name == name:
            return spec
    raise KeyError(f"no weight {name!r} in the table")


def present(cfg: ModelConfig) -> tuple[WeightSpec, ...]:
    """The entries this config has (biases and q/k norms only with their feature, the head only untied)."""
    return tuple(spec for spec in WEIGHTS if spec.present(cfg))


def build(values: dict[str, object]) -> Params:
    """Params from values keyed by field name (a missing field is None)."""
    layers = LayerParams(**{s.name: values.get(s.name) for s in WEIGHTS if s.stacked})
    return Params(layers=layers, **{s.name: values.get(s.name) for s in WEIGHTS if not s.stacked})


def fields_of(params: Params) -> dict[str, object]:
    """Field name -> value of every weight the params hold (layer fields stacked), in table order."""
    out = {}
    for spec in WEIGHTS:
        value = getattr(params.layers if spec.stacked else params, spec.name)
        if value is not None:
            out[spec.name] = value
    return out


def num_params(cfg: ModelConfig) -> int:
    """Parameter count: the elements of every weight the config has (a tied head counted once)."""
    return sum(math.prod(spec.shape(cfg)) for spec in present(cfg))


def abstract(cfg: ModelConfig) -> Params:
    """Params of jax.ShapeDtypeStruct leaves (dense, cfg.dtype): shapes without allocating."""
    dtype = jnp.dtype(cfg.dtype)
    return build({s.name: jax.ShapeDtypeStruct(s.shape(cfg), dtype) for s in present(cfg)})


def weight_format(field: str, quantization: str | None) -> str | None:
    """What `field` is stored as under `quantization`: None (dense, cfg.dtype), "gguf" (the file's
    blocks, where their type is kept), "int8" or "int4". The one owner of this choice.

    Norms and biases stay dense (tiny, and added rather than multiplied). The embedding and the head are
    int8 under both int8 and int4: the head's error lands on the logits unnormalized, and an int8 row per
    vocabulary entry keeps the tied [V, D] table at a quarter of f32 (SmolLM2: 28 of 135M parameters) with a
    per-row scale that serves both the lookup and the head. Under gguf they keep the file's own type.
    """
    spec = weight_spec(field)
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


def quantize_arrays(arrays: dict[str, object], quantization: str, *, group_size: int = DEFAULT_INT4_GROUP_SIZE) -> dict[str, object]:
    """int8 / int4: replace each host f32 matmul weight (Params layout) chosen by `weight_format` with a
    QuantizedTensor; everything else passes through. An int4 group that does not divide a weight's
    input width is a ValueError naming the weight."""
    out = dict(arrays)
    for field, w in arrays.items():
        fmt = weight_format(field, quantization)
        if fmt not in ("int8", "int4") or isinstance(w, quant.QuantizedTensor):
            continue
        rows, logical = _matmul_rows(weight_spec(field), np.asarray(w, np.float32))
        try:
            out[field] = quant.quantize_int8(rows, **logical) if fmt == "int8" else quant.quantize_int4(rows, group_size=group_size, **logical)
        except ValueError as e:
            raise ValueError(f"cannot quantize weight {field!r} {tuple(w.shape)} to int4 with group size {group_size}: {e}") from None
    return out


def _to_device(value, dtype) -> jax.Array | quant.QuantizedTensor:
    if isinstance(value, (quant.QuantizedTensor, MixedQuantStack, KQuantPanelTensor, QuantPanelTensor)):
        return jax.device_put(value)
    return jnp.asarray(value, dtype=dtype)


def _to_host(value, dtype) -> np.ndarray | quant.QuantizedTensor:
    """The weight as host (numpy) leaves, dense ones cast to `dtype` (the same rounding as on a device)."""
    if isinstance(value, (quant.QuantizedTensor, MixedQuantStack)):
        return jax.device_get(value)
    return np.asarray(jax.device_get(value)).astype(dtype, copy=False)


def weight_bytes(params: Params) -> dict[tuple[str, str], int]:
    """Resident device bytes per (tensor kind, storage format), e.g. ("attention", "q4_1"); formats are
    a QuantizedTensor's `format` or a dense array's dtype name. Measured with quant.resident_bytes."""
    totals: dict[tuple[str, str], int] = {}
    for field, value in fields_of(params).items():
        fmt = value.format if isinstance(value, (quant.QuantizedTensor, MixedQuantStack, KQuantPanelTensor, QuantPanelTensor)) else jnp.dtype(value.dtype).name
        key = (weight_spec(field).kind, fmt)
        totals[key] = totals.get(key, 0) + quant.resident_bytes(value)
    return totals


def from_numpy(cfg: ModelConfig, arrays: dict[str, object], *, on_host: bool = False) -> Params:
    """Build Params from host arrays keyed by field name (every WEIGHTS entry the config has), checking
    every shape and casting dense ones to `cfg.dtype`. A value may be a QuantizedTensor (host or device
    leaves) of the expected logical shape; it is put on the device as is.
    `on_host`: keep every leaf in host memory (numpy), for sharding.shard_params to place shard by shard."""
    dtype = jnp.dtype(cfg.dtype)
    for spec in present(cfg):
        shape = spec.shape(cfg)
        if spec.name not in arrays:
            raise ValueError(f"missing weight {spec.name!r}")
        if tuple(arrays[spec.name].shape) != shape:
            raise ValueError(f"weight {spec.name!r} has shape {tuple(arrays[spec.name].shape)}, expected {shape}")
    place = _to_host if on_host else _to_device
    return build({spec.name: place(arrays[spec.name], dtype) for spec in present(cfg)})


def init_random(key: jax.Array, cfg: ModelConfig, scale: float = 0.02) -> Params:
    """Random weights of the given geometry (benchmarks and tests of shapes, never numerics claims)."""
    specs = sorted(present(cfg), key=lambda s: not s.stacked)  # layer weights first, as seeds always drew them
    keys = jax.random.split(key, len(specs))
    arrays = {}
    for sub, spec in zip(keys, specs):
        shape = spec.shape(cfg)
        arrays[spec.name] = np.ones(shape, np.float32) if spec.init == "ones" else np.asarray(jax.random.normal(sub, shape) * scale)
    return from_numpy(cfg, arrays)


def dense_params(params: Params) -> Params:
    """Every quantized matrix of `params` dequantized to float32 (quant.dequantize: for a GGUF's blocks, the
    values the dense load gives, bit for bit)."""
    def dense(leaf):
        if isinstance(leaf, MixedQuantStack):
            return mixed_quant.dequantize(leaf)
        if isinstance(leaf, KQuantPanelTensor):  # K-quant panels packed at load: the same values (panel_tensors.kquant_dense)
            return kquant_dense_stack(leaf)
        if isinstance(leaf, QuantPanelTensor):  # a tied Q8_0 / Q4_0 / Q4_1 table kept once as the head's panels
            return quant_dense(leaf)
        return quant.dequantize(leaf) if isinstance(leaf, quant.QuantizedTensor) else leaf

    quantized = (quant.QuantizedTensor, MixedQuantStack, KQuantPanelTensor, QuantPanelTensor)
    return jax.tree.map(dense, params, is_leaf=lambda leaf: isinstance(leaf, quantized))


def cast_model(cfg: ModelConfig, params: Params, dtype: str) -> tuple[ModelConfig, Params]:
    """`cfg` and `params` in compute dtype `dtype`: every dense floating array cast (as loading with that
    dtype would), quantized tensors kept as they are."""
    if cfg.dtype == dtype:
        return cfg, params
    target = jnp.dtype(dtype)

    def cast(value):
        if isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.floating):
            return value.astype(target)
        return value

    layers = dataclasses.replace(params.layers, **{f.name: cast(getattr(params.layers, f.name)) for f in dataclasses.fields(params.layers)})
    top = {f.name: cast(getattr(params, f.name)) for f in dataclasses.fields(params) if f.name != "layers"}
    return dataclasses.replace(cfg, dtype=dtype), dataclasses.replace(params, layers=layers, **top)
