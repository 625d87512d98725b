"""YaRN rope scaling (Qwen2.5 / Qwen3 at long context) against transformers 5.24 and from GGUF metadata.

tests/fixtures/tiny_qwen2_yarn uses YaRN's defaults (factor 4, beta_fast 32, beta_slow 1, truncate, the
attention factor 0.1 ln(factor) + 1); tiny_qwen3_yarn sets every field (beta_fast 8, beta_slow 0.5, mscale 1
over mscale_all_dim 0.5, truncate false). Both have an original context of 32 and held-out shapes
(tests/reference/make_fixtures.py). The paged engine on tiny_qwen2_yarn is checked across position 32 in
tests/front/test_tokenizerless_folder.py; LongRoPE in tests/loading/test_phi.py.
"""

import dataclasses
import json
import math

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import gguf_convert
from conftest import FIXTURES
from jaxinfer.loading.loading import load_model
from jaxinfer.model.forward import forward
from tolerances import LOGITS_VS_HF_F32, assert_close, relative_error

MODELS = ("tiny_qwen2_yarn", "tiny_qwen3_yarn")


def reference(name: str):
    return np.load(FIXTURES / f"{name}_reference.npz")


def logits(cfg, params, ids) -> np.ndarray:
    ids = jnp.asarray(ids)[None]
    out, _ = forward(params, None, ids, jnp.arange(ids.shape[1], dtype=jnp.int32)[None], cfg=cfg)
    return np.asarray(out[0])


@pytest.fixture(scope="module", params=MODELS)
def yarn_model(request):
    return request.param, load_model(FIXTURES / request.param)


def test_hf_folder_logits_match_transformers_past_the_original_context(yarn_model):
    name, (cfg, params) = yarn_model
    data = reference(name)
    for s in range(3):
        assert_close(logits(cfg, params, data[f"s{s}_ids"]), data[f"s{s}_logits"], LOGITS_VS_HF_F32, f"{name} sequence {s}")


def test_config_reads_every_yarn_field():
    qwen2, qwen3 = (load_model(FIXTURES / name)[0].rope_scaling for name in MODELS)
    mscale = lambda m: 0.1 * m * math.log(4.0) + 1  # noqa: E731
    assert (qwen2.kind, qwen2.factor, qwen2.original_max_position, qwen2.beta_fast, qwen2.beta_slow, qwen2.truncate) == ("yarn", 4.0, 32, 32.0, 1.0, True)
    assert qwen2.attention_factor == pytest.approx(mscale(1.0))
    assert (qwen3.beta_fast, qwen3.beta_slow, qwen3.truncate) == (8.0, 0.5, False)
    assert qwen3.attention_factor == pytest.approx(mscale(1.0) / mscale(0.5))


@pytest.mark.parametrize("control", ["no yarn", "no attention factor", "truncate flipped"])
def test_control_logits_miss_without_each_piece(control):
    cfg, params = load_model(FIXTURES / "tiny_qwen3_yarn")
    scaling = cfg.rope_scaling
    changed = {"no yarn": None, "no attention factor": dataclasses.replace(scaling, attention_factor=1.0),
               "truncate flipped": dataclasses.replace(scaling, truncate=True)}[control]
    data = reference("tiny_qwen3_yarn")
    error = relative_error(logits(dataclasses.replace(cfg, rope_scaling=changed), params, data["s2_ids"]), data["s2_logits"])
    assert error > 10 * LOGITS_VS_HF_F32, f"{control}: the logits moved only by {error:.2g}"


def test_attention_factor_given_in_the_config_wins():
    """transformers takes `attention_factor` as given, over the one factor and mscale would give."""
    from jaxinfer.config import from_hf_config

    config = json.loads((FIXTURES / "tiny_qwen3_yarn" / "config.json").read_text())
    config["rope_parameters"]["attention_factor"] = 0.75
    assert from_hf_config(config).rope_scaling.attention_factor == 0.75


# ---------------------------------------------------------------- GGUF, as llama.cpp's converter writes YaRN


def yarn_gguf(name: str, path):
    """`name` as convert_hf_to_gguf.py writes a Qwen with YaRN (read, not copied): rope.scaling.type "yarn",
    .factor, .original_context_length, and the yarn_beta_* keys where the config sets them; mscale_all_dim
    as rope.scaling.yarn_log_multiplier (as the DeepSeek converters write it)."""
    folder = FIXTURES / name
    config = json.loads((folder / "config.json").read_text())
    rope = config["rope_parameters"]
    writer = gguf.GGUFWriter(str(path), gguf_convert.GGUF_ARCH[config["model_type"]])
    gguf_convert._write_metadata(writer, config)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if "beta_fast" in rope:
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if "mscale_all_dim" in rope:
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
    for tensor_name, value in load_file(folder / "model.safetensors").items():
        writer.add_tensor(gguf_convert._gguf_name(tensor_name), np.asarray(value, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_yarn_logits_match_transformers(tmp_path):
    cfg, params = load_model(yarn_gguf("tiny_qwen2_yarn", tmp_path / "yarn.gguf"))
    data = reference("tiny_qwen2_yarn")
    for s in range(3):
        assert_close(logits(cfg, params, data[f"s{s}_ids"]), data[f"s{s}_logits"], LOGITS_VS_HF_F32, f"qwen2 yarn GGUF sequence {s}")


def test_gguf_yarn_keys_are_read_as_the_folders_config(tmp_path):
    """GGUF has no `truncate` (llama.cpp always rounds the blend range outward); everything else equals."""
    cfg, _ = load_model(yarn_gguf("tiny_qwen3_yarn", tmp_path / "yarn3.gguf"))
    folders = load_model(FIXTURES / "tiny_qwen3_yarn")[0].rope_scaling
    ours = cfg.rope_scaling
    assert dataclasses.replace(ours, truncate=False, attention_factor=1.0) == dataclasses.replace(folders, attention_factor=1.0)
    assert ours.truncate and ours.attention_factor == pytest.approx(folders.attention_factor)
