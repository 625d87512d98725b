"""Gemma 2, 3 and 4 text models against transformers 5.24, from the folder, a GGUF and the paged engine.

tests/reference/make_fixtures.py built each tiny random model (4 layers: sliding ones with a window of 8 and
rope base 1e4, full ones with their own rope: Gemma 3 linear x4 on base 1e6, Gemma 4 proportional rope on a
quarter of the frequencies) and recorded its logits on sequences of 7, 33 and 100 tokens, two of them past
the window. Gemma 3 has query_pre_attn_scalar 24 (not head_dim), norms stored as w for x * (1 + w) and
logits soft-capped at 1; Gemma 4 has a weightless v norm, per-layer scalars and logits soft-capped at 2;
Gemma 2 (no q/k norms, one rope base, every other layer sliding) is built without attention soft-capping
here; tests/model/test_softcap_attention.py covers a Gemma 2 with it.
Controls switch each feature off and the logits then miss, so every comparison can fail.
"""

import dataclasses
import functools
import json

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import FIXTURES
import gguf_files
from gemma_gguf import gemma_gguf
from jaxinfer.config import RopeScaling, from_hf_config
from jaxinfer.loading.loading import ModelLoadError, load_model
from jaxinfer.model import params as params_lib
from jaxinfer.model.forward import forward
from tolerances import LOGITS_VS_HF_F32, assert_close, relative_error

NAMES = ("tiny_gemma2", "tiny_gemma3", "tiny_gemma4")
SEQUENCES = range(3)
WINDOW = 8


def reference(name: str):
    return np.load(FIXTURES / f"{name}_reference.npz")


def logits(cfg, params, ids) -> np.ndarray:
    ids = jnp.asarray(ids)[None]
    out, _ = forward(params, None, ids, jnp.arange(ids.shape[1], dtype=jnp.int32)[None], cfg=cfg)
    return np.asarray(out[0])


@functools.cache
def loaded(name: str):
    return load_model(FIXTURES / name, max_context=128)


@pytest.fixture(scope="module", params=NAMES)
def gemma(request):
    return request.param, loaded(request.param)


def test_hf_folder_logits_match_transformers_for_every_sequence(gemma):
    name, (cfg, params) = gemma
    data = reference(name)
    for s in SEQUENCES:
        assert_close(logits(cfg, params, data[f"s{s}_ids"]), data[f"s{s}_logits"], LOGITS_VS_HF_F32, f"{name} sequence {s}")


def test_config_reads_the_gemma_features():
    g3 = load_model(FIXTURES / "tiny_gemma3")[0]
    assert (g3.architecture, g3.sliding_window, g3.local_rope_theta, g3.rope_theta) == ("gemma3", WINDOW, 1e4, 1e6)
    assert g3.layer_types == ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention")
    assert g3.rope_scaling == RopeScaling(kind="linear", factor=4.0)
    assert (g3.hidden_act, g3.post_norms, g3.qk_norm, g3.v_norm, g3.layer_scale) == ("gelu_tanh", True, True, False, False)
    assert (g3.norm_weight_offset, g3.embed_scale, g3.query_scale, g3.final_logit_softcap) == (1.0, 8.0, 24**-0.5, 1.0)
    g4 = load_model(FIXTURES / "tiny_gemma4")[0]
    assert g4.layer_types == ("sliding_attention", "full_attention") * 2
    assert g4.rope_scaling.frequency_factors == (1.0,) * 4 + (float("inf"),) * 12  # 0.25 of 16 frequencies turn
    assert (g4.norm_weight_offset, g4.query_scale, g4.v_norm, g4.layer_scale, g4.final_logit_softcap) == (0.0, 1.0, True, True, 2.0)
    g2 = load_model(FIXTURES / "tiny_gemma2")[0]
    assert (g2.architecture, g2.qk_norm, g2.local_rope_theta, g2.rope_scaling, g2.final_logit_softcap) == ("gemma2", False, None, None, 1.5)
    assert g2.layer_types == ("sliding_attention", "full_attention") * 2 and g2.norm_weight_offset == 1.0


CONTROLS = [
    ("tiny_gemma3", dict(local_rope_theta=None)),  # the full layers' rope on the sliding ones too
    ("tiny_gemma3", dict(layer_types=("full_attention",) * 4)),  # no window on the sliding layers
    ("tiny_gemma3", dict(layer_types=("sliding_attention",) * 4)),  # the full layer windowed
    ("tiny_gemma3", dict(rope_scaling=None)),
    ("tiny_gemma3", dict(query_scale=None)),
    ("tiny_gemma3", dict(final_logit_softcap=None)),
    ("tiny_gemma3", dict(hidden_act="silu")),
    ("tiny_gemma3", dict(embed_scale=1.0)),
    ("tiny_gemma2", dict(layer_types=("full_attention",) * 4)),
    ("tiny_gemma2", dict(query_scale=None)),
    ("tiny_gemma4", dict(v_norm=False)),
    ("tiny_gemma4", dict(layer_scale=False)),
    ("tiny_gemma4", dict(rope_scaling=None)),  # every frequency turned (no proportional rope)
    ("tiny_gemma4", dict(query_scale=None)),
]


@pytest.mark.parametrize("name, change", CONTROLS, ids=lambda v: v if isinstance(v, str) else ",".join(v))
def test_control_logits_miss_when_a_feature_is_switched_off(name, change):
    cfg, params = loaded(name)
    data = reference(name)
    error = relative_error(logits(dataclasses.replace(cfg, **change), params, data["s2_ids"]), data["s2_logits"])
    assert error > 10 * LOGITS_VS_HF_F32, f"{name} {change}: the logits changed only by {error:.2g}"


def test_control_gemma3_norms_without_the_one_added_at_load_miss(tmp_path):
    """The HF loader adds 1 to every Gemma 3 norm weight: a folder whose config says gemma4 (offset 0) but
    holds the same tensors and features loads them as they are, and misses."""
    cfg, params = loaded("tiny_gemma3")
    norms = {spec.name for spec in params_lib.present(cfg) if spec.name.endswith("norm")}
    assert norms == {"attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm", "final_norm"}
    file = load_file(FIXTURES / "tiny_gemma3" / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(params.final_norm), file["model.norm.weight"] + 1)
    shifted = params_lib.fields_of(params)
    shifted.update({name: np.asarray(shifted[name]) - 1 for name in norms})
    data = reference("tiny_gemma3")
    error = relative_error(logits(cfg, params_lib.from_numpy(cfg, shifted), data["s2_ids"]), data["s2_logits"])
    assert error > 10 * LOGITS_VS_HF_F32


# ---------------------------------------------------------------- GGUF, as llama.cpp's Gemma converter writes it (tests/gemma_gguf.py)

@pytest.mark.parametrize("name", ["tiny_gemma2", "tiny_gemma3"])
def test_gguf_loads_the_folders_weights_and_config(tmp_path, name):
    """Every weight equals the folder's (norms: the GGUF's w + 1 against the loader's 1 + w); the config
    equals the folder's except the query scale, which llama.cpp fixes at head_dim ** -0.5 (27B:
    (embed_dim / heads) ** -0.5) and a GGUF cannot carry: with the folder's scale the logits match transformers."""
    hf_cfg, hf_params = loaded(name)
    cfg, params = load_model(gemma_gguf(FIXTURES / name, tmp_path / "g.gguf"), max_context=128)
    assert cfg.query_scale is None and hf_cfg.query_scale == 24**-0.5
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)  # stored as f32
    same = dataclasses.replace(cfg, query_scale=hf_cfg.query_scale, norm_weight_offset=1.0, rms_norm_eps=hf_cfg.rms_norm_eps)
    assert same == hf_cfg
    for field, value in params_lib.fields_of(hf_params).items():
        np.testing.assert_array_equal(np.asarray(params_lib.fields_of(params)[field]), np.asarray(value), err_msg=field)
    data = reference(name)
    for s in SEQUENCES:
        assert_close(logits(same, params, data[f"s{s}_ids"]), data[f"s{s}_logits"], LOGITS_VS_HF_F32, f"{name} GGUF sequence {s}")


def test_q8_gguf_keeps_blocks_and_stays_close(tmp_path):
    from jaxinfer.model import quant

    path = gemma_gguf(FIXTURES / "tiny_gemma3", tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    cfg, params = load_model(path, max_context=128, quantization="gguf")
    assert isinstance(params.layers.wq, quant.QuantizedTensor) and isinstance(params.layers.w_down, quant.QuantizedTensor)
    data = reference("tiny_gemma3")
    error = relative_error(logits(dataclasses.replace(cfg, query_scale=24**-0.5), params, data["s1_ids"]), data["s1_logits"])
    assert 0 < error <= 0.05, f"Q8_0 gemma3: relative error {error:.3g}"


# ---------------------------------------------------------------- bad input: one clear line


def _config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


@pytest.mark.parametrize("change, message", [
    ({"hidden_size_per_layer_input": 256}, "per-layer input embeddings"),
    ({"num_kv_shared_layers": 2}, "KV shared across layers"),
    ({"enable_moe_block": True}, "mixture-of-experts"),
    ({"attention_k_eq_v": True}, "keys reused as values"),
    ({"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
])
def test_gemma_features_jaxinfer_does_not_run_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config({**_config("tiny_gemma4"), **change})


# Written as the published google/gemma-3-1b-it config.json and gemma-3-4b-it's sparse text_config (which leaves
# the rest to Gemma3TextConfig's defaults); the expected full layers and ropes are what transformers 5.24's
# Gemma3TextConfig makes of them.
GEMMA3_1B = dict(architectures=["Gemma3ForCausalLM"], attn_logit_softcapping=None, final_logit_softcapping=None, head_dim=256,
                 hidden_activation="gelu_pytorch_tanh", hidden_size=1152, intermediate_size=6912, max_position_embeddings=32768,
                 model_type="gemma3_text", num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1, query_pre_attn_scalar=256,
                 rms_norm_eps=1e-06, rope_local_base_freq=10000, rope_scaling=None, rope_theta=1000000, sliding_window=512,
                 sliding_window_pattern=6, vocab_size=262144)
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "vision_config": {},
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
                             "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}


def test_published_gemma3_configs_read_as_transformers_reads_them():
    one = from_hf_config(GEMMA3_1B, max_context=4096)
    assert [i for i, t in enumerate(one.layer_types) if t == "full_attention"] == [5, 11, 17, 23]
    assert (one.rope_theta, one.local_rope_theta, one.rope_scaling, one.query_scale, one.sliding_window) == (1e6, 1e4, None, 1 / 16, 512)
    assert (one.num_kv_heads, one.head_dim, one.tie_embeddings, one.embed_scale) == (1, 256, True, 1152**0.5)
    four = from_hf_config(GEMMA3_4B, max_context=4096)
    assert [i for i, t in enumerate(four.layer_types) if t == "full_attention"] == [5, 11, 17, 23, 29]
    assert (four.vocab_size, four.num_heads, four.num_kv_heads, four.head_dim, four.sliding_window) == (262208, 8, 4, 256, 1024)
    assert (four.rope_scaling.kind, four.rope_scaling.factor, four.rope_theta, four.local_rope_theta) == ("linear", 8.0, 1e6, 1e4)


def test_gemma4_with_its_own_head_size_for_full_layers_is_named():
    config = {k: v for k, v in _config("tiny_gemma4").items() if k != "per_layer_config"}  # as published: global_head_dim
    with pytest.raises(ValueError, match="unsupported global_head_dim 512 != head_dim 32"):
        from_hf_config(config)
    assert from_hf_config({**config, "global_head_dim": 32}).head_dim == 32


def test_multimodal_gemma3_config_and_names_load_the_text_model(tmp_path):
    """A Gemma 3 4B-style folder (model_type gemma3, text_config, tensors under model.language_model.)."""
    from safetensors.numpy import save_file

    text = _config("tiny_gemma3")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text, "vision_config": {}}))
    tensors = {name.replace("model.", "model.language_model.", 1): value for name, value in load_file(FIXTURES / "tiny_gemma3" / "model.safetensors").items()}
    save_file({**tensors, "model.vision_tower.x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    cfg, params = load_model(tmp_path, max_context=128)
    data = reference("tiny_gemma3")
    assert_close(logits(cfg, params, data["s1_ids"]), data["s1_logits"], LOGITS_VS_HF_F32, "multimodal folder")


def test_info_names_the_gemma_features(capsys):
    from jaxinfer import cli

    assert cli.main(["info", "--model", str(FIXTURES / "tiny_gemma3")]) == 0
    out = capsys.readouterr().out
    for line in ("family            gemma3", "layer types       3 sliding, 1 full", "local rope base   10000", "logit softcap     1"):
        assert line in out, out


def test_bad_gemma_gguf_input_is_a_load_error(tmp_path):
    path = gemma_gguf(FIXTURES / "tiny_gemma3", tmp_path / "g3.gguf")
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["gemma3.attention.sliding_window"].contents() == WINDOW
    writer = gguf.GGUFWriter(str(tmp_path / "capped.gguf"), "gemma2")
    writer.add_attn_logit_softcapping(-50.0)  # a soft-cap must be > 0
    for key in ("block_count", "embedding_length", "feed_forward_length", "head_count"):
        getattr(writer, f"add_{key}")(64 if key != "block_count" else 1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    gguf_files.finish(writer)
    with pytest.raises(ModelLoadError, match="attn_logit_softcap"):
        load_model(tmp_path / "capped.gguf")


# ---------------------------------------------------------------- the paged engine, past the window


@pytest.fixture(scope="module")
def gemma3_llm(compile_cache):
    from jaxinfer.api import LLM

    return LLM(str(FIXTURES / "tiny_gemma3"), compilation_cache_dir=compile_cache, dtype="float32", quantization=None,
               attention_impl="reference", matmul_impl="xla", max_context=128, page_size=8, max_num_seqs=2,
               max_prefill_tokens=32, prefill_chunk_buckets=(32,), decode_batch_buckets=(2,), decode_page_buckets=(16,))


def test_engine_prompt_logprobs_of_a_long_prompt_match_transformers(gemma3_llm):
    """100 tokens prefilled in chunks of 32 over pages of 8: the sliding layers' window crosses chunks and pages."""
    from jaxinfer.scheduling.request import SamplingParams

    data = reference("tiny_gemma3")
    ids, ref = data["s2_ids"], data["s2_logits"].astype(np.float64)
    out = gemma3_llm.generate([ids.tolist()], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    expected = ref[np.arange(len(ids) - 1), ids[1:]] - np.logaddexp.reduce(ref[:-1], axis=1)
    np.testing.assert_allclose([lp for lp, _ in out.prompt_logprobs[1:]], expected, atol=1e-4, rtol=0)


def test_engine_greedy_decode_past_the_window_equals_the_full_forward(gemma3_llm):
    """Greedy decode steps read the paged cache (the full layer every page, the sliding ones the last 8
    positions); each chosen token is the argmax of the no-cache forward over the whole sequence (which
    matches transformers above) and its logprob equals that forward's."""
    from jaxinfer.scheduling.request import SamplingParams

    cfg, params = loaded("tiny_gemma3")
    prompt = reference("tiny_gemma3")["s1_ids"].tolist()  # 33 tokens
    out = gemma3_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, logprobs=0, ignore_eos=True))[0]
    full = logits(cfg, params, np.asarray(prompt + out.token_ids, np.int32)).astype(np.float64)
    rows = full[len(prompt) - 1 : -1]  # the rows that chose each generated token
    assert out.token_ids == rows.argmax(axis=1).tolist()
    expected = rows[np.arange(len(rows)), out.token_ids] - np.logaddexp.reduce(rows, axis=1)
    np.testing.assert_allclose([lp for lp, _ in out.logprobs], expected, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- llama.cpp itself on the same GGUFs

# llama.cpp's CPU GELU reads a table of fp16 values at the fp16-rounded input (ggml_vec_gelu_f32 under
# GGML_GELU_FP16), so its Gemma logits sit ~3e-4 from an f32 GELU's; jaxinfer computes GELU in f32, as
# transformers does. Emulating that table brings the two within 2e-4.
LOGITS_VS_LLAMA_CPP_GELU = 1e-3


def _gelu_fp16_table(x):
    import jax

    y = jax.nn.gelu(x.astype(jnp.float16).astype(jnp.float32), approximate=True).astype(jnp.float16).astype(jnp.float32)
    return jnp.where(x <= -10, 0.0, jnp.where(x >= 10, x, y)).astype(x.dtype)


@pytest.mark.parametrize("name", ["tiny_gemma2", "tiny_gemma3"])
def test_gguf_logits_match_llama_cpp_on_the_same_file(tmp_path, monkeypatch, name):
    """llama-cpp-python 0.3.36 (f32 KV cache) evaluated the GGUF that gemma_gguf writes
    (tests/reference/make_gemma_llama_cpp_fixtures.py): jaxinfer loads it as llama.cpp does, query scale
    included, and a misread layer pattern misses."""
    from jaxinfer.model import forward as forward_module

    cfg, params = load_model(gemma_gguf(FIXTURES / name, tmp_path / f"{name}.gguf", no_vocab=True), max_context=128)
    llama_cpp, data = np.load(FIXTURES / f"{name}_llama_cpp.npz"), reference(name)
    for s in SEQUENCES:
        assert_close(logits(cfg, params, data[f"s{s}_ids"]), llama_cpp[f"s{s}_logits"], LOGITS_VS_LLAMA_CPP_GELU, f"{name} vs llama.cpp, sequence {s}")
    misread = dataclasses.replace(cfg, layer_types=("full_attention",) * cfg.num_layers)
    assert relative_error(logits(misread, params, data["s2_ids"]), llama_cpp["s2_logits"]) > 10 * LOGITS_VS_LLAMA_CPP_GELU
    monkeypatch.setitem(forward_module._ACTIVATIONS, "gelu_tanh", _gelu_fp16_table)
    assert_close(logits(cfg, params, data["s2_ids"]), llama_cpp["s2_logits"], 2e-4, f"{name} vs llama.cpp, its fp16 GELU table emulated")
