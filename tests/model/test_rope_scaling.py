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

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from long_rope_gguf import yarn_gguf
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


# ---------------------------------------------------------------- GGUF, as llama.cpp's converter writes YaRN (tests/long_rope_gguf.py)


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


def test_gguf_yarn_logits_match_llama_cpp_on_the_same_file(tmp_path):
    """llama-cpp-python 0.3.36 (n_ctx 256, f32 KV cache; tests/reference/make_long_rope_llama_cpp_fixtures.py)."""
    llama_cpp = np.load(FIXTURES / "llama_cpp_long_rope_logits.npz")
    cfg, params = load_model(yarn_gguf("tiny_qwen2_yarn", tmp_path / "yarn.gguf"))
    data = reference("tiny_qwen2_yarn")
    for s in range(3):
        assert_close(logits(cfg, params, data[f"s{s}_ids"]), llama_cpp[f"tiny_qwen2_yarn_s{s}_logits"], LOGITS_VS_HF_F32, f"qwen2 yarn vs llama.cpp, sequence {s}")
