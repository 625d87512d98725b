"""Each family (Llama 3 rope scaling, linear and dynamic rope, Mistral, Qwen2, Qwen3) against transformers.

transformers built each tiny random model at its family's features, saved it as config.json +
safetensors and recorded its logits on three sequences, one (100 tokens) longer than every scaled rope's
original context (tests/reference/make_fixtures.py). jaxinfer loads each folder, and a GGUF written from
it the way llama.cpp's converter writes one (tests/gguf_convert.py), and must match those logits. Controls
switch each feature off and show the logits then miss, so every comparison can fail.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import gguf_convert
import gguf_files
from conftest import FIXTURES
from jaxinfer.loading import loading
from jaxinfer.config import RopeScaling, from_hf_config
from jaxinfer.loading.loading import ModelLoadError, load_model
from jaxinfer.model.forward import forward
from tolerances import LOGITS_VS_HF_F32, assert_close, relative_error

# name -> (architecture, features that must be read, max_context to load with)
FAMILIES = {
    "tiny_llama3": ("llama", {"rope_scaling": "llama3"}, None),
    "tiny_llama_linear": ("llama", {"rope_scaling": "linear"}, None),
    "tiny_llama_dynamic": ("llama", {"rope_scaling": "dynamic"}, 256),  # past max_position_embeddings (32)
    "tiny_mistral": ("mistral", {"sliding_window": 128}, None),
    "tiny_qwen2": ("qwen2", {"attention_bias": True, "tie_embeddings": True}, None),
    "tiny_qwen3": ("qwen3", {"qk_norm": True, "tie_embeddings": True}, None),
}
GGUF_FAMILIES = [name for name in FAMILIES if name != "tiny_llama_dynamic"]  # llama.cpp converts no dynamic rope
SEQUENCES = range(3)


def reference(name: str):
    return np.load(FIXTURES / f"{name}_reference.npz")


def logits(cfg, params, ids) -> np.ndarray:
    ids = jnp.asarray(ids)[None]
    out, _ = forward(params, None, ids, jnp.arange(ids.shape[1], dtype=jnp.int32)[None], cfg=cfg)
    return np.asarray(out[0])


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf_family(request):
    name = request.param
    return name, load_model(FIXTURES / name, max_context=FAMILIES[name][2])


@pytest.fixture(scope="module", params=GGUF_FAMILIES)
def gguf_family(request, tmp_path_factory):
    name = request.param
    path = gguf_convert.convert(FIXTURES / name, tmp_path_factory.mktemp("gguf") / f"{name}.gguf")
    return name, path, load_model(path)


def _feature_value(cfg, feature):
    value = getattr(cfg, feature)
    return value.kind if isinstance(value, RopeScaling) else value


def test_hf_folder_logits_match_transformers_for_every_sequence(hf_family):
    name, (cfg, params) = hf_family
    data = reference(name)
    for s in SEQUENCES:
        assert_close(logits(cfg, params, data[f"s{s}_ids"]), data[f"s{s}_logits"], LOGITS_VS_HF_F32, f"{name} sequence {s}")


def test_hf_config_features_are_read(hf_family):
    name, (cfg, _) = hf_family
    architecture, features, _ = FAMILIES[name]
    assert cfg.architecture == architecture
    assert {feature: _feature_value(cfg, feature) for feature in features} == features


@pytest.mark.parametrize("name", [name for name in FAMILIES if name != "tiny_mistral"])  # Mistral has nothing to switch off
def test_control_logits_miss_when_the_family_feature_is_switched_off(name):
    cfg, params = load_model(FIXTURES / name, max_context=FAMILIES[name][2])
    off = dataclasses.replace(cfg, rope_scaling=None, attention_bias=False, qk_norm=False)
    data = reference(name)
    error = relative_error(logits(off, params, data["s2_ids"]), data["s2_logits"])
    assert error > 10 * LOGITS_VS_HF_F32, f"{name}: switching the feature off changed the logits only by {error:.2g}"


def test_gguf_logits_match_transformers_for_every_sequence(gguf_family):
    name, path, (cfg, params) = gguf_family
    data = reference(name)
    for s in SEQUENCES:
        assert_close(logits(cfg, params, data[f"s{s}_ids"]), data[f"s{s}_logits"], LOGITS_VS_HF_F32, f"{name} GGUF sequence {s}")


def test_gguf_config_equals_hf_config_in_shape_and_features(gguf_family):
    name, _, (cfg, _) = gguf_family
    hf_cfg, _ = load_model(FIXTURES / name)
    fields = ("num_layers", "embed_dim", "ffn_dim", "num_heads", "num_kv_heads", "head_dim", "rope_theta", "attention_bias", "qk_norm", "tie_embeddings")
    assert {f: getattr(cfg, f) for f in fields} == {f: getattr(hf_cfg, f) for f in fields}


@pytest.mark.parametrize("name", ["tiny_qwen2", "tiny_qwen3", "tiny_llama3"])
def test_control_logits_miss_when_the_q_k_permutation_choice_is_flipped(tmp_path, monkeypatch, name):
    """Q/K rows are un-permuted only for architecture "llama": flipping that choice for one family breaks it."""
    path = gguf_convert.convert(FIXTURES / name, tmp_path / f"{name}.gguf")
    arch = gguf_convert.GGUF_ARCH[_config(name)["model_type"]]
    flipped = tuple(a for a in loading.SUPPORTED_GGUF_ARCHS if (a in loading._GGUF_PERMUTED_QK) != (a == arch))
    monkeypatch.setattr(loading, "_GGUF_PERMUTED_QK", flipped)
    cfg, params = load_model(path)
    data = reference(name)
    assert relative_error(logits(cfg, params, data["s1_ids"]), data["s1_logits"]) > 10 * LOGITS_VS_HF_F32


def test_q8_gguf_of_qwen3_is_close_to_transformers(tmp_path):
    path = gguf_convert.convert(FIXTURES / "tiny_qwen3", tmp_path / "q8.gguf", gguf_convert.gguf.GGMLQuantizationType.Q8_0)
    data = reference("tiny_qwen3")
    cfg, params = load_model(path)
    error = relative_error(logits(cfg, params, data["s2_ids"]), data["s2_logits"])
    # Q8_0 rounds each block of 32 weights to 8 bits; q/k norm rescales the rounded q and k, so the tiny
    # model lands near 2% (the plain Llama's Q8_0 test in test_loading.py sees about 1%).
    assert 0 < error <= 0.04, f"Q8_0 qwen3: relative error {error:.3g}"


# ---------------------------------------------------------------- bad input: one clear line


def _config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


@pytest.mark.parametrize("rope_type", ["su", "mrope"])  # yarn and longrope load (tests/model/test_rope_scaling.py, tests/loading/test_phi.py)
def test_unsupported_rope_type_in_config_is_named(tmp_path, rope_type):
    config = _config("tiny_llama3")
    config["rope_parameters"] = {"rope_type": rope_type, "rope_theta": 1e4, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"config.json: .*unsupported rope type '{rope_type}'"):
        load_model(tmp_path)


def test_mistral_context_runs_past_its_sliding_window():
    cfg, _ = load_model(FIXTURES / "tiny_mistral", max_context=256)
    assert (cfg.sliding_window, cfg.max_context) == (128, 256)
    assert from_hf_config(_config("tiny_mistral")).max_context == 256  # default: max_position_embeddings, not the window


def test_gguf_of_unknown_architecture_is_named(tmp_path):
    path = gguf_convert.convert(FIXTURES / "tiny_qwen3", tmp_path / "x.gguf", arch="mamba")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load_model(path)


def test_gguf_with_unsupported_rope_scaling_is_named(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "yarn.gguf"), "llama")
    writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)  # without llama.cpp's rope_factors_* tensors
    for key in ("block_count", "embedding_length", "feed_forward_length", "head_count"):
        getattr(writer, f"add_{key}")(64 if key != "block_count" else 1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    gguf_files.finish(writer)
    with pytest.raises(ModelLoadError, match="unsupported rope type 'longrope'"):
        load_model(tmp_path / "yarn.gguf")


@pytest.mark.parametrize(
    "change, message",
    [({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"), ({"mlp_bias": True}, "unsupported mlp_bias"), ({"attention_bias": True}, "unsupported attention_bias")],
)
def test_config_features_jaxinfer_does_not_run_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config({**_config("tiny_llama3"), **change})


# ---------------------------------------------------------------- jaxinfer info


@pytest.mark.parametrize(
    "name, as_gguf, expected",
    [
        ("tiny_llama3", True, ["family            llama", "rope scaling      frequency_factors", "tokenizer         none (no tokenizer.ggml metadata)"]),
        ("tiny_llama3", False, ["family            llama", "rope scaling      llama3 (factor 8)"]),
        ("tiny_qwen2", False, ["family            qwen2", "q/k/v bias        yes", "q/k norm          no", "tokenizer         none (no tokenizer.json)"]),
        ("tiny_qwen3", True, ["family            qwen3", "q/k norm          yes", "q/k/v bias        no"]),
        ("tiny_mistral", False, ["family            mistral", "sliding window    128 tokens"]),
    ],
)
def test_info_names_the_family_and_its_features(tmp_path, capsys, name, as_gguf, expected):
    from jaxinfer import cli

    path = gguf_convert.convert(FIXTURES / name, tmp_path / f"{name}.gguf") if as_gguf else FIXTURES / name
    assert cli.main(["info", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert all(line in out for line in expected), out


# ---------------------------------------------------------------- llama.cpp itself on the same GGUFs

LLAMA_CPP_LOGITS = np.load(FIXTURES / "llama_cpp_logits.npz")  # tests/reference/make_llama_cpp_fixtures.py


@pytest.mark.parametrize("name", sorted({key.rsplit("_s", 1)[0] for key in LLAMA_CPP_LOGITS.files}))
def test_gguf_logits_match_llama_cpp_on_the_same_file(tmp_path, name):
    """llama-cpp-python 0.3.36 (f32 KV cache) evaluated the GGUF that gguf_convert writes for `name`."""
    cfg, params = load_model(gguf_convert.convert(FIXTURES / name, tmp_path / f"{name}.gguf", no_vocab=True))
    data = reference(name)
    for s in SEQUENCES:
        assert_close(logits(cfg, params, data[f"s{s}_ids"]), LLAMA_CPP_LOGITS[f"{name}_s{s}_logits"], LOGITS_VS_HF_F32, f"{name} vs llama.cpp, sequence {s}")
