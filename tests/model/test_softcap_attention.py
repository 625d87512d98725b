"""Attention logit soft-capping (Gemma 2's attn_logit_softcapping): every attention path against a float64
numpy softmax of cap * tanh(scaled score / cap), and a tiny Gemma 2 with the cap against transformers 5.24.

The rule is transformers' Gemma 2 eager attention (models/gemma2/modeling_gemma2.py, eager_attention_forward):
scores = q k^T * scaling; scores = tanh(scores / cap) * cap; then the mask and the softmax. The jnp paths
(no cache, dense slab, paged, deterministic page blocks, packed rows), the CPU C++ kernel and its reference,
and the Pallas Mosaic GPU decode kernel (GPU interpreter, CUDA lowering) and its reference are each checked,
and each against a control with the cap off, which misses.

The fixture tiny_gemma2_softcap (tests/reference/make_fixtures.py, GEMMA_FAMILIES) is tiny_gemma2's shape with
attn_logit_softcapping=1.0: a cap that bites on its small random scores (published Gemma 2 uses 50).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import kernel_interpret
import tolerances
from conftest import FIXTURES
from gemma_gguf import gemma_gguf
from jaxinfer.config import ModelConfig, from_hf_config
from jaxinfer.loading.loading import load_model
from jaxinfer.model import attention as at
from jaxinfer.model import kv_pool as kvp
from jaxinfer.model.forward import forward
from kernels_cpu import paged_attention as cpu
from kernels_pallas import paged_attention as pa

CAP = 2.0  # the single-call tests' cap; their scores have a standard deviation of ~4, so the cap bites
NAME = "tiny_gemma2_softcap"


def capped_f64(q, keys, values, q_pos, k_pos, cap, k_seg=None, q_seg=None, sm_scale=None):
    """[B, T, H, K] float64: GQA softmax of cap * tanh(q.k * sm_scale / cap) over keys at k_pos <= q_pos (and equal
    segments); cap None: no cap. keys/values [B, S, G, K]; k_pos [#B, S]. A query that sees nothing gets zeros."""
    q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
    b, t, h, k = q.shape
    g = keys.shape[2]
    sm_scale = k**-0.5 if sm_scale is None else sm_scale
    out = np.zeros((b, t, h, k))
    for row in range(b):
        kp = np.asarray(k_pos)[min(row, len(k_pos) - 1)]
        for i in range(t):
            visible = kp <= int(q_pos[row, i])
            if k_seg is not None:
                visible &= np.asarray(k_seg)[row] == int(q_seg[row, i])
            for head in range(h):
                s = keys[row, visible, head // (h // g)] @ q[row, i, head] * sm_scale
                s = s if cap is None else cap * np.tanh(s / cap)
                if s.size:
                    p = np.exp(s - s.max())
                    out[row, i, head] = p @ values[row, visible, head // (h // g)] / p.sum()
    return out


def _rand(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def _check(out, q, keys, values, q_pos, k_pos, what, tol=1e-5, **segments):
    """out within tol (max abs) of the capped rule, and further than 100 * tol from the uncapped one."""
    expected = capped_f64(q, keys, values, q_pos, k_pos, CAP, **segments)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=tol, err_msg=what)
    uncapped = capped_f64(q, keys, values, q_pos, k_pos, None, **segments)
    assert np.abs(np.asarray(out, np.float64) - uncapped).max() > 100 * tol, f"{what}: the cap changes nothing here"


# ------------------------------------------------------------------ the jnp paths of attention.py


def test_no_cache_and_dense_cache_cap_the_scores():
    rng = np.random.default_rng(0)
    b, t, h, g, k = 2, 12, 4, 2, 8
    q, keys, values = _rand(rng, b, t, h, k, scale=2.0), _rand(rng, b, t, g, k, scale=2.0), _rand(rng, b, t, g, k)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out, _ = at.attend(None, 0, q, keys, values, positions, softcap=CAP)
    _check(out, q, keys, values, positions, np.asarray(positions), "no cache")
    cache = kvp.DenseKVCache(jnp.zeros((1, b, 16, g, k)), jnp.zeros((1, b, 16, g, k)))
    out, _ = at.attend(cache, jnp.int32(0), q, keys, values, positions, softcap=CAP)
    _check(out, q, keys, values, positions, np.arange(t)[None], "dense cache")


def _paged_case(rng, page_size=4, pages_per_row=6, t=3):
    """One layer's pool, per-row tables (one sequence per row), t queries per row, and the keys and values
    each row's table names, [B, S, G, K]."""
    b, h, g, k = 2, 4, 2, 8
    num_pages = 1 + b * pages_per_row
    pool = kvp.KVPool(_rand(rng, 1, g, num_pages, k, page_size, scale=2.0), _rand(rng, 1, g, num_pages, page_size, k))
    tables = jnp.asarray(np.arange(1, num_pages, dtype=np.int32).reshape(b, pages_per_row))
    last = pages_per_row * page_size - 1
    q_positions = jnp.asarray([np.arange(last - t + 1, last + 1), np.arange(9, 9 + t)], jnp.int32)
    keys = np.asarray(pool.k[0]).transpose(0, 1, 3, 2)[:, tables].transpose(1, 2, 3, 0, 4).reshape(b, -1, g, k)
    values = np.asarray(pool.v[0])[:, tables].transpose(1, 2, 3, 0, 4).reshape(b, -1, g, k)
    return pool, tables, q_positions, keys, values, _rand(rng, b, t, h, k, scale=2.0)


@pytest.mark.parametrize("t", [1, 3])  # decode ([B, G, Q, T, S] scores) and a prefill chunk (keys-major scores)
@pytest.mark.parametrize("impl", ["reference", at.DETERMINISTIC_IMPL, at.CPU_IMPL])
def test_paged_paths_cap_the_scores(impl, t):
    pool, tables, q_positions, keys, values, q = _paged_case(np.random.default_rng(t), t=t)
    pages = kvp.PageMeta(tables, jnp.zeros(q_positions.shape, jnp.int32), jnp.zeros(q_positions.shape, jnp.int32))
    if impl == at.CPU_IMPL:
        out = at._attend_cpu(q, pool, 0, q_positions, pages, softcap=CAP)
    else:
        k_pages, v_pages = kvp.gather_pages(pool, 0, tables)
        over = at.attention_over_page_blocks if impl == at.DETERMINISTIC_IMPL else at.attention_over_pages
        out = over(q, k_pages, v_pages, q_positions, at.key_layout(pages, pool.page_size), softcap=CAP)
    _check(out, q, keys, values, q_positions, np.arange(keys.shape[1])[None], impl)


def test_packed_row_caps_the_scores_within_each_sequence():
    rng = np.random.default_rng(3)
    page_size, g, h, k = 4, 1, 2, 8
    pool = kvp.KVPool(_rand(rng, 1, g, 12, k, page_size, scale=2.0), _rand(rng, 1, g, 12, page_size, k))
    # one row: sequence 0 on pages 1..4 (positions 0..15), sequence 1 on pages 5..7 (positions 0..11)
    tables = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 0]], jnp.int32)
    page_positions = jnp.asarray([[0, 4, 8, 12, 0, 4, 8, 0]], jnp.int32)
    page_segments = jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 2]], jnp.int32)
    q_positions, q_segments = jnp.asarray([[14, 15, 10, 11]], jnp.int32), jnp.asarray([[0, 0, 1, 1]], jnp.int32)
    pages = kvp.PageMeta(tables, q_positions * 0, q_positions * 0, page_positions, page_segments, q_segments)
    q = _rand(rng, 1, 4, h, k, scale=2.0)
    keys = np.asarray(pool.k[0]).transpose(0, 1, 3, 2)[:, tables].transpose(1, 2, 3, 0, 4).reshape(1, -1, g, k)
    values = np.asarray(pool.v[0])[:, tables].transpose(1, 2, 3, 0, 4).reshape(1, -1, g, k)
    slot_positions = (np.asarray(page_positions)[..., None] + np.arange(page_size)).reshape(1, -1)
    segments = dict(k_seg=np.repeat(np.asarray(page_segments), page_size, 1), q_seg=q_segments)
    k_pages, v_pages = kvp.gather_pages(pool, 0, tables)
    layout = at.key_layout(pages, page_size)
    for name, over in (("jnp", at.attention_over_pages), ("deterministic", at.attention_over_page_blocks)):
        out = over(q, k_pages, v_pages, q_positions, layout, softcap=CAP)
        _check(out, q, keys, values, q_positions, slot_positions, f"packed row, {name}", **segments)
    out = at._attend_cpu(q, pool, 0, q_positions, pages, softcap=CAP)
    _check(out, q, keys, values, q_positions, slot_positions, "packed row, CPU kernel", **segments)


# ------------------------------------------------------------------ the CPU kernel and its reference


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("page_size,head_dim", [(4, 8), (16, 64)])  # the generic path and a compiled-in geometry
def test_cpu_kernel_and_its_reference_cap_a_prefill_chunk(page_size, head_dim):
    rng = np.random.default_rng(page_size)
    b, h, g, e = 2, 4, 2, 4
    num_pages = 1 + b * e
    k_pool = rng.standard_normal((2, g, num_pages, head_dim, page_size)).astype(np.float32) * 2
    v_pool = rng.standard_normal((2, g, num_pages, page_size, head_dim)).astype(np.float32)
    tables = np.arange(1, num_pages, dtype=np.int32).reshape(b, e)
    q_pos = np.array([[e * page_size - 3, e * page_size - 2, e * page_size - 1], [4, 5, 6]], np.int32)
    q = rng.standard_normal((b, 3, h, head_dim)).astype(np.float32) * 2
    keys = k_pool[1].transpose(0, 1, 3, 2)[:, tables].transpose(1, 2, 3, 0, 4).reshape(b, -1, g, head_dim)
    values = v_pool[1][:, tables].transpose(1, 2, 3, 0, 4).reshape(b, -1, g, head_dim)
    k_pos = np.arange(e * page_size)[None]
    out = jax.jit(cpu.paged_attention, static_argnames="softcap")(q, k_pool, v_pool, jnp.int32(1), tables, q_pos, softcap=CAP)
    _check(out, q, keys, values, q_pos, k_pos, "kernel")
    _check(cpu.reference(q, k_pool, v_pool, 1, tables, q_pos, softcap=CAP), q, keys, values, q_pos, k_pos, "reference")


def test_a_soft_cap_must_be_positive():
    q = jnp.zeros((1, 1, 2, 8))
    pool = jnp.zeros((1, 1, 3, 8, 4))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
            cpu.paged_attention(q, pool, pool.swapaxes(-1, -2), 0, jnp.ones((1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32), softcap=bad)
        with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
            pa.paged_attention_reference(q[:, 0], pool[0], pool[0].swapaxes(-1, -2), jnp.ones((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), softcap=bad)
    with pytest.raises(ValueError, match="attn_logit_softcap"):
        ModelConfig(vocab_size=8, num_layers=1, embed_dim=8, ffn_dim=8, num_heads=1, num_kv_heads=1, head_dim=8, attn_logit_softcap=-50.0)


# ------------------------------------------------------------------ the Pallas decode kernel


def _decode_case(lengths, num_kv_heads, group_size, head_dim, page_size, seed=0, dtype=jnp.bfloat16):
    """q [B, H, K], one layer's pages and tables, lengths, and the keys/values [B, S, G, K] the tables name."""
    rng = np.random.default_rng(seed)
    batch, max_pages = len(lengths), max(-(-n // page_size) for n in lengths)
    num_pages = batch * max_pages + 1
    tables = np.zeros((batch, max_pages), np.int32)
    ids = rng.permutation(np.arange(1, num_pages))
    for row, n in enumerate(lengths):
        tables[row, : -(-n // page_size)] = ids[row * max_pages : row * max_pages - (-n // page_size)]
    as_dtype = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731  (the values the kernel sees)
    q = as_dtype(rng.standard_normal((batch, num_kv_heads * group_size, head_dim)) * 2)
    k = as_dtype(rng.standard_normal((num_kv_heads, num_pages, head_dim, page_size)) * 2)
    v = as_dtype(rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)))
    keys = k.transpose(0, 1, 3, 2)[:, tables].transpose(1, 2, 3, 0, 4).reshape(batch, -1, num_kv_heads, head_dim)
    values = v[:, tables].transpose(1, 2, 3, 0, 4).reshape(batch, -1, num_kv_heads, head_dim)
    lengths = np.asarray(lengths, np.int32)
    k_pos = np.where(np.arange(keys.shape[1]) < lengths[:, None], np.arange(keys.shape[1]), 10**9)  # past the length: unseen
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables), jnp.asarray(lengths))
    return args, (q[:, None], keys, values, (lengths - 1)[:, None], k_pos)


def test_pallas_reference_caps_the_scores():
    args, case = _decode_case((1, 70, 200), 2, 3, 64, 64, dtype=jnp.float32)
    out = pa.paged_attention_reference(*args, softcap=CAP)
    _check(np.asarray(out)[:, None], *case, "Pallas reference")


def test_pallas_kernel_caps_the_scores_in_interpreter():
    """bf16 pages, two splits: the kernel's (approximate) tanh against the float64 rule at the bf16 bound."""
    args, case = _decode_case((5, 130, 300), 1, 4, 64, 64, seed=5)
    config = pa.PagedAttentionConfig(num_splits=2, pipeline_depth=2)
    with kernel_interpret.gpu_interpreter() as params:
        out = jax.block_until_ready(pa.paged_attention(*args, softcap=CAP, config=config, interpret=params))
        assert not kernel_interpret.races_found(), "race detector fired"
    out = np.asarray(out, np.float32)[:, None]
    expected, uncapped = capped_f64(*case, CAP), capped_f64(*case, None)
    tolerances.assert_close(out, expected, tolerances.KERNEL_BF16, "kernel, capped")
    assert tolerances.relative_error(out, uncapped) > 5 * tolerances.KERNEL_BF16, "the cap changes nothing here"


@pytest.mark.parametrize("deterministic,quantized", [(False, False), (True, True)])
def test_pallas_kernel_with_a_soft_cap_lowers_for_cuda(deterministic, quantized):
    batch, max_pages, g, group, head_dim, page_size = 4, 8, 2, 4, 128, 64
    config = pa.deterministic_config(head_dim, page_size, group) if deterministic else pa.config_for(batch, max_pages, g, group, head_dim, page_size)
    num_pages = batch * max_pages + 1
    kv = jnp.int8 if quantized else jnp.bfloat16
    shapes = [
        jax.ShapeDtypeStruct((batch, g * group, head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, g, num_pages, head_dim, page_size), kv),
        jax.ShapeDtypeStruct((2, g, num_pages, page_size, head_dim), kv),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),  # layer
    ]
    scales = [jax.ShapeDtypeStruct((2, g, num_pages, page_size), jnp.float32)] * 2 if quantized else []

    def fn(q, k, v, t, n, layer, *scale):
        extra = dict(k_scales=scale[0], v_scales=scale[1]) if scale else {}
        return pa.paged_attention(q, k, v, t, n, layer=layer, softcap=50.0, config=config, **extra)

    exported = export.export(jax.jit(fn), platforms=("cuda",), disabled_checks=[export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")])(*shapes, *scales)
    assert "mosaic_gpu" in exported.mlir_module()


def test_pallas_dispatch_hands_the_cap_to_the_kernel(monkeypatch):
    """Decode in bf16 with impl='pallas': attend gives the kernel (here its reference, through a spy, as no GPU
    runs here) the model's cap, and the result is the capped rule's."""
    caps = []

    def spy(q, k_pages, v_pages, block_tables, lengths, *, layer=None, config=None, softcap=None):
        caps.append(softcap)
        return pa.paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, layer=layer, softcap=softcap)

    monkeypatch.setattr(pa, "paged_attention", spy)
    pool, tables, q_positions, keys, values, q = _paged_case(np.random.default_rng(11), page_size=64, pages_per_row=1, t=1)
    pool = kvp.KVPool(pool.k.astype(jnp.bfloat16), pool.v.astype(jnp.bfloat16))
    q, positions = q.astype(jnp.bfloat16), jnp.asarray([[40], [20]], jnp.int32)
    meta = kvp.PageMeta(tables, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32))
    k_new = v_new = jnp.zeros((2, 1, 2, 8), jnp.bfloat16)  # written to the null page, which no table names
    out = jax.jit(lambda pool: at.attend(pool, jnp.int32(0), q, k_new, v_new, positions, meta, impl="pallas", softcap=CAP)[0])(pool)
    assert caps == [CAP]
    keys = np.asarray(pool.k[0].astype(jnp.float32)).transpose(0, 1, 3, 2)[:, tables].transpose(1, 2, 3, 0, 4).reshape(2, -1, 2, 8)
    values = np.asarray(pool.v[0].astype(jnp.float32))[:, tables].transpose(1, 2, 3, 0, 4).reshape(2, -1, 2, 8)
    _check(np.asarray(out, np.float32), q.astype(jnp.float32), keys, values, positions, np.arange(keys.shape[1])[None], "pallas dispatch", tol=2e-2)


# ------------------------------------------------------------------ a tiny Gemma 2 with the cap, against transformers


@pytest.fixture(scope="module")
def gemma2():
    return load_model(FIXTURES / NAME, max_context=128)


def _logits(cfg, params, ids) -> np.ndarray:
    ids = jnp.asarray(ids)[None]
    out, _ = forward(params, None, ids, jnp.arange(ids.shape[1], dtype=jnp.int32)[None], cfg=cfg)
    return np.asarray(out[0])


def test_config_reads_the_cap_from_hf_and_from_a_gguf(gemma2, tmp_path):
    """HF: attn_logit_softcapping (50 in a published Gemma 2 config); GGUF: gemma2.attn_logit_softcapping."""
    cfg, _ = gemma2
    assert cfg.attn_logit_softcap == 1.0 and cfg.final_logit_softcap == 1.5
    published = from_hf_config({"model_type": "gemma2", "attn_logit_softcapping": 50.0})  # the rest: Gemma2Config's defaults
    assert published.attn_logit_softcap == 50.0
    assert from_hf_config({"model_type": "gemma2", "attn_logit_softcapping": None}).attn_logit_softcap is None
    from_gguf, params = load_model(gemma_gguf(FIXTURES / NAME, tmp_path / "capped.gguf"), max_context=128)
    assert from_gguf.attn_logit_softcap == 1.0
    # llama.cpp fixes Gemma 2's query scale at head_dim ** -0.5 (a GGUF cannot carry the folder's; tests/loading/test_gemma.py)
    same = dataclasses.replace(from_gguf, query_scale=cfg.query_scale, norm_weight_offset=1.0, rms_norm_eps=cfg.rms_norm_eps)
    assert same == cfg  # its logits: against llama.cpp's below


def test_forward_matches_transformers_and_misses_without_the_cap(gemma2):
    cfg, params = gemma2
    data = np.load(FIXTURES / f"{NAME}_reference.npz")
    for s in (0, 2):  # 7 and 100 tokens: the sliding layers' window (8) crossed
        tolerances.assert_close(_logits(cfg, params, data[f"s{s}_ids"]), data[f"s{s}_logits"], tolerances.LOGITS_VS_HF_F32, f"sequence {s}")
    uncapped = _logits(dataclasses.replace(cfg, attn_logit_softcap=None), params, data["s2_ids"])
    assert tolerances.relative_error(uncapped, data["s2_logits"]) > 10 * tolerances.LOGITS_VS_HF_F32


@pytest.mark.parametrize("impl", ["cpu", pytest.param("reference", marks=pytest.mark.slow)])
def test_paged_engine_prompt_logprobs_match_transformers(gemma2, smollm2_tokenizer, compile_cache, impl):
    """100 tokens prefilled in chunks of 32 over pages of 8, then greedy decode: prompt log-probs within 1e-4 of
    transformers' log-softmax, and each decoded token the argmax of the no-cache forward."""
    from jaxinfer.api import LLM
    from jaxinfer.scheduling.request import SamplingParams

    cfg, params = gemma2
    llm = LLM.from_params(
        cfg, params, smollm2_tokenizer, attention_impl=impl, matmul_impl="xla", compilation_cache_dir=compile_cache,
        max_context=128, page_size=8, max_num_seqs=2, max_prefill_tokens=32, prefill_chunk_buckets=(32,), max_prefill_seqs=1,
        prefill_seq_buckets=(1,), decode_batch_buckets=(2,), decode_page_buckets=(16,),
    )
    data = np.load(FIXTURES / f"{NAME}_reference.npz")
    ids, ref = data["s2_ids"], data["s2_logits"].astype(np.float64)
    prompt = data["s1_ids"].tolist()
    scored, generated = llm.generate([ids.tolist(), prompt], [SamplingParams(max_tokens=0, prompt_logprobs=0),
                                                              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    expected = ref[np.arange(len(ids) - 1), ids[1:]] - np.logaddexp.reduce(ref[:-1], axis=1)
    np.testing.assert_allclose([lp for lp, _ in scored.prompt_logprobs[1:]], expected, atol=1e-4, rtol=0)
    full = _logits(cfg, params, np.asarray(prompt + generated.token_ids, np.int32))
    assert generated.token_ids == full[len(prompt) - 1 : -1].argmax(axis=1).tolist()


def _gelu_fp16_table(x):
    """llama.cpp's CPU GELU (GGML_GELU_FP16): an fp16 table read at the fp16-rounded input (as tests/loading/test_gemma.py)."""
    y = jax.nn.gelu(x.astype(jnp.float16).astype(jnp.float32), approximate=True).astype(jnp.float16).astype(jnp.float32)
    return jnp.where(x <= -10, 0.0, jnp.where(x >= 10, x, y)).astype(x.dtype)


def test_gguf_logits_match_llama_cpp_on_the_same_file_and_miss_without_the_cap(tmp_path, monkeypatch):
    """llama-cpp-python 0.3.36 (f32 KV cache) evaluated the soft-capped GGUF gemma_gguf writes
    (tests/reference/make_softcap_llama_cpp_fixture.py): with llama.cpp's fp16 GELU table emulated, jaxinfer is
    within 2e-4 of it on two sequences, and the cap switched off misses by over 10 times that."""
    from jaxinfer.model import forward as forward_module

    cfg, params = load_model(gemma_gguf(FIXTURES / NAME, tmp_path / "capped.gguf", no_vocab=True), max_context=128)
    llama_cpp, data = np.load(FIXTURES / f"{NAME}_llama_cpp.npz"), np.load(FIXTURES / f"{NAME}_reference.npz")
    monkeypatch.setitem(forward_module._ACTIVATIONS, "gelu_tanh", _gelu_fp16_table)
    for s in (1, 2):  # 33 and 100 tokens
        tolerances.assert_close(_logits(cfg, params, data[f"s{s}_ids"]), llama_cpp[f"s{s}_logits"], 2e-4, f"vs llama.cpp, sequence {s}")
    uncapped = _logits(dataclasses.replace(cfg, attn_logit_softcap=None), params, data["s2_ids"])
    assert tolerances.relative_error(uncapped, llama_cpp["s2_logits"]) > 10 * 2e-4
