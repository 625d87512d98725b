"""Phi-3 / Phi-4-mini against transformers 5.24: fused qkv_proj and gate_up_proj, LongRoPE, partial rotary.

tests/fixtures/tiny_phi3 is a random Phi3ForCausalLM of a held-out shape (D 96, 6 heads over 2 kv heads,
2 layers) with LongRoPE on 3/4 of each head (Phi-4-mini's partial_rotary_factor) and an original context of
32, so that two of the three reference sequences (7, 33, 100 tokens) take the long factors and one the short
(tests/reference/make_fixtures.py). jaxinfer must match its logits from the folder, from a config written the
way Phi-3's published config.json is, and from a GGUF written as llama.cpp's Phi-3 converter writes one
(attn_qkv, ffn_up holding gate then up, rope_factors_long/short, rope.dimension_count, attn_factor); and the
paged engine must reproduce transformers' greedy continuation with its cache across position 32. Controls
switch each piece off and show the logits then miss.
"""

import dataclasses
import json
import math
import shutil

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from long_rope_gguf import phi3_gguf
from jaxinfer.loading.loading import load_model
from jaxinfer.model.forward import forward
from tolerances import LOGITS_VS_HF_F32, assert_close, relative_error

NAME = "tiny_phi3"
FOLDER = FIXTURES / NAME
DATA = np.load(FIXTURES / f"{NAME}_reference.npz")
CONFIG = json.loads((FOLDER / "config.json").read_text())
ROPE = CONFIG["rope_parameters"]


def logits(cfg, params, ids) -> np.ndarray:
    ids = jnp.asarray(ids)[None]
    out, _ = forward(params, None, ids, jnp.arange(ids.shape[1], dtype=jnp.int32)[None], cfg=cfg)
    return np.asarray(out[0])


def assert_matches_transformers(cfg, params, what: str) -> None:
    for s in range(3):
        assert_close(logits(cfg, params, DATA[f"s{s}_ids"]), DATA[f"s{s}_logits"], LOGITS_VS_HF_F32, f"{what} sequence {s}")


@pytest.fixture(scope="module")
def phi3():
    return load_model(FOLDER)


def test_hf_folder_logits_match_transformers_on_both_longrope_branches(phi3):
    assert_matches_transformers(*phi3, "phi3 folder")


def test_config_reads_longrope_partial_rotary_and_its_attention_factor(phi3):
    cfg, params = phi3
    scaling = cfg.rope_scaling
    assert (cfg.architecture, cfg.head_dim, cfg.rotary_dim, scaling.kind, scaling.original_max_position) == ("phi3", 16, 12, "longrope", 32)
    assert scaling.short_factors == tuple(ROPE["short_factor"]) and scaling.long_factors == tuple(ROPE["long_factor"])
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(256 / 32) / math.log(32)))  # factor = 256 / 32
    assert params.layers.wq.shape == (2, 96, 6, 16) and params.layers.w_gate.shape == (2, 96, 128)


def _with_rope(cfg, **changes):
    return dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, **changes))


@pytest.mark.parametrize("control", ["short factors only", "no attention factor", "every dim rotated", "gate and up swapped"])
def test_control_logits_miss_without_each_piece(phi3, control):
    cfg, params = phi3
    scaling = cfg.rope_scaling
    if control == "short factors only":
        cfg = _with_rope(cfg, long_factors=scaling.short_factors)
    elif control == "no attention factor":
        cfg = _with_rope(cfg, attention_factor=1.0)
    elif control == "every dim rotated":
        cfg = dataclasses.replace(cfg, rotary_dim=None, rope_scaling=None)
    else:
        layers = dataclasses.replace(params.layers, w_gate=params.layers.w_up, w_up=params.layers.w_gate)
        params = dataclasses.replace(params, layers=layers)
    error = relative_error(logits(cfg, params, DATA["s2_ids"]), DATA["s2_logits"])
    assert error > 10 * LOGITS_VS_HF_F32, f"{control}: the logits moved only by {error:.2g}"


def test_config_written_as_phi3s_published_one_gives_the_same_logits(tmp_path):
    """Phi-3's own config.json: `rope_scaling` with type "longrope", rope_theta, partial_rotary_factor and
    original_max_position_embeddings at top level (transformers 5 moves them into rope_parameters)."""
    config = {k: v for k, v in CONFIG.items() if k != "rope_parameters"}
    config.update(rope_theta=ROPE["rope_theta"], partial_rotary_factor=ROPE["partial_rotary_factor"],
                  rope_scaling={"type": "longrope", "short_factor": ROPE["short_factor"], "long_factor": ROPE["long_factor"]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(FOLDER / "model.safetensors", tmp_path / "model.safetensors")
    assert_matches_transformers(*load_model(tmp_path), "phi3 published-style config")


# ---------------------------------------------------------------- GGUF, as llama.cpp's Phi-3 converter writes it (tests/long_rope_gguf.py)


def test_gguf_logits_match_transformers_and_its_config_the_folders(tmp_path, phi3):
    cfg, params = load_model(phi3_gguf(tmp_path / "phi3.gguf"))
    assert_matches_transformers(cfg, params, "phi3 GGUF")
    fields = ("architecture", "num_kv_heads", "head_dim", "rotary_dim", "rope_theta", "tie_embeddings")
    assert {f: getattr(cfg, f) for f in fields} == {f: getattr(phi3[0], f) for f in fields}
    ours, folders = cfg.rope_scaling, phi3[0].rope_scaling  # the GGUF stores the factors in f32
    assert (ours.kind, ours.original_max_position, ours.factor) == (folders.kind, folders.original_max_position, folders.factor)
    np.testing.assert_allclose([ours.attention_factor, *ours.short_factors, *ours.long_factors],
                               [folders.attention_factor, *folders.short_factors, *folders.long_factors], rtol=1e-7)


def test_q8_gguf_keeps_the_fused_tensors_blocks_split_by_rows(tmp_path):
    """quantization="gguf": every matmul weight stays Q8_0 blocks, the fused attn_qkv and ffn_up split by rows."""
    from jaxinfer.model import quant

    cfg, params = load_model(phi3_gguf(tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0), quantization="gguf")
    assert all(isinstance(getattr(params.layers, f), quant.QuantizedTensor) for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    error = relative_error(logits(cfg, params, DATA["s2_ids"]), DATA["s2_logits"])
    assert 0 < error < 0.03, f"Q8_0 phi3: relative error {error:.3g}"


# ---------------------------------------------------------------- the paged engine


@pytest.fixture(scope="module")
def phi3_llm(compile_cache):
    from jaxinfer.api import LLM

    return LLM(str(FOLDER), compilation_cache_dir=compile_cache, dtype="float32", quantization=None, attention_impl="reference",
               matmul_impl="xla", max_context=128, page_size=16, max_num_seqs=2, max_prefill_tokens=128,
               prefill_chunk_buckets=(32, 128), decode_batch_buckets=(2,), decode_page_buckets=(8,))


def test_engine_greedy_across_the_original_context_equals_transformers_with_its_cache(phi3_llm):
    """A 26-token prompt prefilled with short factors, then decode steps past position 32 with long ones
    while the cached keys keep theirs: what transformers' cache does too."""
    from jaxinfer.scheduling.request import SamplingParams

    out = phi3_llm.generate([DATA["g_prompt_ids"].tolist()], SamplingParams(temperature=0, max_tokens=len(DATA["g_ids"]), logprobs=0, ignore_eos=True))[0]
    assert out.token_ids == DATA["g_ids"].tolist()
    expected = [float(row[i] - np.logaddexp.reduce(row.astype(np.float64))) for row, i in zip(DATA["g_logits"], DATA["g_ids"])]
    np.testing.assert_allclose([lp for lp, _ in out.logprobs], expected, atol=1e-4, rtol=0)


def test_engine_prompt_logprobs_of_a_long_prompt_match_transformers(phi3_llm):
    from jaxinfer.scheduling.request import SamplingParams

    ids, ref = DATA["s2_ids"], DATA["s2_logits"].astype(np.float64)
    out = phi3_llm.generate([ids.tolist()], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    expected = ref[np.arange(len(ids) - 1), ids[1:]] - np.logaddexp.reduce(ref[:-1], axis=1)
    np.testing.assert_allclose([lp for lp, _ in out.prompt_logprobs[1:]], expected, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- llama.cpp itself on the same GGUF

LLAMA_CPP = np.load(FIXTURES / "llama_cpp_long_rope_logits.npz")  # tests/reference/make_long_rope_llama_cpp_fixtures.py


def test_gguf_logits_match_llama_cpp_past_the_original_context_and_differ_before_it(tmp_path):
    """llama-cpp-python 0.3.36 (n_ctx 256, f32 KV cache) on the same file. Past the original context both take
    the long factors. On the 7-token sequence llama.cpp still does (it picks them once for the whole context,
    n_ctx > original), transformers and jaxinfer take the short ones: jaxinfer follows transformers there."""
    cfg, params = load_model(phi3_gguf(tmp_path / "phi3.gguf"))
    for s in (1, 2):
        assert_close(logits(cfg, params, DATA[f"s{s}_ids"]), LLAMA_CPP[f"tiny_phi3_s{s}_logits"], LOGITS_VS_HF_F32, f"phi3 vs llama.cpp, sequence {s}")
    assert relative_error(LLAMA_CPP["tiny_phi3_s0_logits"], DATA["s0_logits"]) > 10 * LOGITS_VS_HF_F32
    assert_close(logits(cfg, params, DATA["s0_ids"]), DATA["s0_logits"], LOGITS_VS_HF_F32, "phi3 GGUF short sequence vs transformers")
