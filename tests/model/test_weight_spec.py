"""The weight table (params.WEIGHTS) is the one owner of the Params metadata, and the declared Params
classes match it.

On the real table, over the tiny Llama (untied head), Qwen2 (q/k/v biases) and Qwen3 (q/k norms), which
between them hold every entry: each entry is a field of the declared classes (optional exactly when the
table gives it a condition), is abstracted and initialized at the shape it loads with, is loaded from the
Hugging Face tensors it names (layer i from layer i's tensor), is named when missing from the file, gets
its PartitionSpec from its logical axes, is counted by weight_bytes, and is a leaf of the pytree that jit
carries.
"""

import dataclasses
import functools
import math
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES
from jaxinfer.loading import loading
from jaxinfer.model import sharding
from jaxinfer.model import params as params_lib

FAMILIES = ("tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_gemma4")  # Gemma 4: post norms and per-layer scalars
SPLIT_AXES = {"q_heads", "kv_heads", "mlp", "vocab"}  # the axes tensor parallelism splits where they divide


@functools.cache
def _loaded(family: str):
    """(cfg, params, the file's tensors by HF name) of a tiny fixture family."""
    cfg, params = loading.load_hf_folder(FIXTURES / family)
    return cfg, params, {k: np.asarray(v, np.float32) for k, v in load_file(FIXTURES / family / "model.safetensors").items()}


def _family_with(spec: params_lib.WeightSpec) -> str:
    return next(family for family in FAMILIES if spec.present(_loaded(family)[0]))


def _field(params, spec: params_lib.WeightSpec):
    return getattr(params.layers if spec.stacked else params, spec.name)


ENTRIES = pytest.mark.parametrize("spec", params_lib.WEIGHTS, ids=lambda spec: spec.name)


def test_declared_fields_equal_the_table_names():
    layer_fields = dataclasses.fields(params_lib.LayerParams)
    top_fields = dataclasses.fields(params_lib.Params)
    assert [f.name for f in layer_fields] == [s.name for s in params_lib.WEIGHTS if s.stacked]
    assert [f.name for f in top_fields if f.name != "layers"] == [s.name for s in params_lib.WEIGHTS if not s.stacked]
    assert [f.name for f in top_fields] == ["embed", "layers", "final_norm", "lm_head"]
    optional = {f.name for f in (*layer_fields, *top_fields) if f.default is None}
    assert optional == {s.name for s in params_lib.WEIGHTS if s.present is not params_lib.always}


def test_the_fixture_families_hold_every_entry():
    """So that the tests below, one per entry, each run on a model that has it."""
    held = {spec.name for family in FAMILIES for spec in params_lib.present(_loaded(family)[0])}
    assert held == {spec.name for spec in params_lib.WEIGHTS}


@ENTRIES
def test_each_entry_is_abstracted_and_initialized_at_the_shape_it_loads_with(spec):
    cfg, params, _ = _loaded(_family_with(spec))
    loaded_shape = tuple(_field(params, spec).shape)
    assert tuple(_field(params_lib.abstract(cfg), spec).shape) == loaded_shape
    assert tuple(_field(params_lib.init_random(jax.random.key(0), cfg), spec).shape) == loaded_shape


def _as_file_layout(value: np.ndarray, spec: params_lib.WeightSpec, cfg, file_shape) -> np.ndarray:
    """One layer of a field back in the file's layout: [*in, *out] matrices as HF's [out, in], others reshaped."""
    if spec.from_file is params_lib.transposed:
        sizes = params_lib.axis_sizes(cfg)
        return value.reshape(math.prod(sizes[a] for a in spec.in_axes), -1).T
    if spec.from_file is params_lib.broadcast:  # one file value spread over the field: every element must be it
        assert np.all(value == value.reshape(-1)[0])
        return value.reshape(-1)[: math.prod(file_shape)].reshape(file_shape)
    return value.reshape(file_shape)


@ENTRIES
def test_each_entry_loads_from_the_hf_tensors_it_names(spec):
    cfg, params, tensors = _loaded(_family_with(spec))
    value = np.asarray(_field(params, spec))
    layers = value if spec.stacked else [value]
    names = [spec.hf.format(i=i) for i in range(cfg.num_layers)] if spec.stacked else [spec.hf]
    assert len(layers) == len(names)
    for layer, name in zip(layers, names):  # layer i from layer i's tensor: a mixed-up layer or name shows
        np.testing.assert_array_equal(_as_file_layout(layer, spec, cfg, tensors[name].shape), tensors[name], err_msg=name)


@ENTRIES
def test_each_entry_missing_from_the_file_is_named(spec, tmp_path):
    family = _family_with(spec)
    cfg, _, tensors = _loaded(family)
    missing = spec.hf.format(i=cfg.num_layers - 1)  # the last layer's, for a stacked entry
    shutil.copy(FIXTURES / family / "config.json", tmp_path / "config.json")
    save_file({k: v for k, v in tensors.items() if k != missing}, str(tmp_path / "model.safetensors"))
    if spec.name == "lm_head":  # some exports omit a tied head without saying so: the loader ties it
        assert loading.load_hf_folder(tmp_path)[1].lm_head is None
        return
    with pytest.raises(loading.ModelLoadError, match=f"'{missing}' is missing"):
        loading.load_hf_folder(tmp_path)


@ENTRIES
def test_each_entry_shards_by_its_logical_axes(spec):
    cfg, params, _ = _loaded(_family_with(spec))
    sizes = params_lib.axis_sizes(cfg)
    assert all(sizes[axis] % 2 == 0 for axis in SPLIT_AXES)  # the tiny models split every such axis at TP = 2
    expected = PartitionSpec(*("model" if axis in SPLIT_AXES else None for axis in spec.axes))
    assert _field(sharding.param_specs(params, cfg, 2), spec) == expected


def test_an_axis_that_does_not_divide_is_replicated_and_placing_keeps_the_values(tiny_llama):
    cfg, params = tiny_llama
    assert cfg.ffn_dim % 2 == 0 and cfg.ffn_dim % 3 != 0  # the "mlp" rule splits at TP = 2 only
    assert sharding.param_specs(params, cfg, 2).layers.w_up == PartitionSpec(None, None, "model")
    assert sharding.param_specs(params, cfg, 3).layers.w_up == PartitionSpec(None, None, None)
    placed = sharding.shard_params(params, cfg, sharding.make_mesh(1))
    for name, value in params_lib.fields_of(params).items():
        np.testing.assert_array_equal(np.asarray(params_lib.fields_of(placed)[name]), np.asarray(value), err_msg=name)


def test_weight_bytes_count_every_entry_once(tiny_llama):
    cfg, params = tiny_llama
    totals = params_lib.weight_bytes(params)
    assert set(totals) == {(kind, "float32") for kind in params_lib.KINDS}
    assert sum(totals.values()) == 4 * cfg.num_params()
    d, f = cfg.embed_dim, cfg.ffn_dim
    assert totals[("mlp", "float32")] == 4 * cfg.num_layers * (3 * d * f + d)  # gate, up, down and the norm, per layer


@pytest.mark.parametrize("family", FAMILIES)
def test_every_present_entry_is_a_leaf_that_jit_carries(family):
    cfg, params, _ = _loaded(family)
    assert len(jax.tree.leaves(params)) == len(params_lib.present(cfg))
    carried = jax.jit(lambda p: p)(params)
    for name, value in params_lib.fields_of(params).items():
        np.testing.assert_array_equal(np.asarray(params_lib.fields_of(carried)[name]), np.asarray(value), err_msg=name)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_gemma4"])
def test_config_parameter_count_agrees_with_the_table(family):
    """ModelConfig.num_params still counts by hand; `jaxinfer info` prints it, so it must equal the table's."""
    cfg, _ = loading.load_hf_folder(FIXTURES / family)
    assert params_lib.num_params(cfg) == cfg.num_params()
