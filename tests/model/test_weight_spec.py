"""The weight table (params.WEIGHTS) is the one owner of the Params layout.

A copy of the table with one more entry, a per-layer bias of the MLP's up projection that no model file
of ours has, is all it takes for the new field to be abstracted and initialized, loaded from a Hugging
Face folder that holds it, given its PartitionSpec from its logical axes, counted by `jaxinfer info`'s
byte table, and carried through `forward`. Nothing else is edited, and no module global is patched.
"""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES
from jaxinfer.loading import loading
from jaxinfer.model import sharding
from jaxinfer.model import params as params_lib
from jaxinfer.model.forward import forward

FAKE = params_lib.WeightSpec("b_up", ("layers", "mlp"), "mlp", "model.layers.{i}.mlp.up_proj.bias", "blk.{i}.ffn_up.bias")
TABLE = params_lib.WEIGHTS + (FAKE,)


def _fake_bias(cfg) -> np.ndarray:
    """Distinct values per layer and channel [N, F], so a mixed-up layer or a transpose shows."""
    return np.arange(cfg.num_layers * cfg.ffn_dim, dtype=np.float32).reshape(cfg.num_layers, cfg.ffn_dim) / 1000


@pytest.fixture(scope="module")
def folder_with_fake(tmp_path_factory, tiny_llama):
    """The tiny HF Llama folder plus the fake tensor of every layer."""
    cfg, _ = tiny_llama
    folder = tmp_path_factory.mktemp("tiny_llama_with_b_up")
    shutil.copy(FIXTURES / "tiny_llama" / "config.json", folder / "config.json")
    weights = {k: np.asarray(v) for k, v in load_file(FIXTURES / "tiny_llama" / "model.safetensors").items()}
    bias = _fake_bias(cfg)
    weights |= {FAKE.hf.format(i=i): bias[i] for i in range(cfg.num_layers)}
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def test_a_new_entry_is_a_field_of_abstract_and_random_params(tiny_llama):
    cfg, _ = tiny_llama
    shape = (cfg.num_layers, cfg.ffn_dim)
    assert params_lib.abstract(cfg, TABLE).layers.b_up.shape == shape
    assert params_lib.init_random(jax.random.key(0), cfg, table=TABLE).layers.b_up.shape == shape
    assert not hasattr(params_lib.abstract(cfg).layers, "b_up")  # control: the real table has no such field
    assert params_lib.num_params(cfg, TABLE) == params_lib.num_params(cfg) + cfg.num_layers * cfg.ffn_dim


def test_a_new_entry_loads_from_its_hf_tensors(tiny_llama, folder_with_fake):
    cfg, _ = tiny_llama
    _, params = loading.load_hf_folder(folder_with_fake, table=TABLE)
    np.testing.assert_array_equal(np.asarray(params.layers.b_up), _fake_bias(cfg))
    _, real = loading.load_hf_folder(folder_with_fake)  # the real table ignores the extra tensor
    np.testing.assert_array_equal(np.asarray(params.layers.w_up), np.asarray(real.layers.w_up))


def test_a_new_entry_missing_from_the_file_is_named(tmp_path):
    shutil.copytree(FIXTURES / "tiny_llama", tmp_path / "tiny", dirs_exist_ok=True)
    with pytest.raises(loading.ModelLoadError, match=r"'model\.layers\.0\.mlp\.up_proj\.bias' is missing"):
        loading.load_hf_folder(tmp_path / "tiny", table=TABLE)


def test_a_new_entry_shards_by_its_logical_axes(tiny_llama, folder_with_fake):
    cfg, _ = tiny_llama
    _, params = loading.load_hf_folder(folder_with_fake, table=TABLE)
    assert cfg.ffn_dim % 2 == 0 and cfg.ffn_dim % 3 != 0  # the "mlp" rule splits at TP = 2 only
    assert sharding.param_specs(params, cfg, 2).layers.b_up == PartitionSpec(None, "model")
    assert sharding.param_specs(params, cfg, 3).layers.b_up == PartitionSpec(None, None)
    placed = sharding.shard_params(params, cfg, sharding.make_mesh(1))
    np.testing.assert_array_equal(np.asarray(placed.layers.b_up), _fake_bias(cfg))


def test_a_new_entry_is_counted_and_forward_still_runs(tiny_llama, folder_with_fake):
    cfg, _ = tiny_llama
    _, params = loading.load_hf_folder(folder_with_fake, table=TABLE)
    _, real = loading.load_hf_folder(folder_with_fake)
    extra = params_lib.weight_bytes(params)[("mlp", "float32")] - params_lib.weight_bytes(real)[("mlp", "float32")]
    assert extra == 4 * cfg.num_layers * cfg.ffn_dim
    tokens = jnp.arange(1, 9, dtype=jnp.int32)[None]
    positions = jnp.arange(8, dtype=jnp.int32)[None]
    run = jax.jit(lambda p: forward(p, None, tokens, positions, cfg=cfg)[0])
    logits, expected = run(params), run(real)  # the model does not read b_up
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(expected))


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_config_parameter_count_agrees_with_the_table(family):
    """ModelConfig.num_params still counts by hand; `jaxinfer info` prints it, so it must equal the table's."""
    cfg, _ = loading.load_hf_folder(FIXTURES / family)
    assert params_lib.num_params(cfg) == cfg.num_params()
