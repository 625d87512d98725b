"""A tied Q8_0 / Q4_0 / Q4_1 embedding is kept once: as the head's quantized panels (loading/kept_blocks.py,
panel_tensors.QuantPanelTensor layout "out_in"), which the lookup also reads (panel_tensors.quant_take: each token's
column gathered from its panel, only those rows dequantized). Gemma 3's Q4_K_M files keep such a Q8_0 table.

- The gathered rows, and the whole table as dense_params reads it, are gguf.quants.dequantize's values bit for bit
  (an independent dequantizer), on a vocabulary that ends inside a panel; the row-chunked packing at load gives the
  arrays panels.to_quant_panels gives whole.
- A tied Gemma 3 Q8_0 file loads with its embedding as panels and no head; pack_panels adds no copy.
- Its logits equal those of the two-copy layout (the stored blocks for the lookup, the head packed from them):
  through the quantized kernel exactly, through the dense read to f32 rounding; the W8A8 exact reference of the
  one-copy params matches the kernel.
"""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from gemma_gguf import gemma_gguf
from jaxinfer.loading import kept_blocks, loading
from jaxinfer.model import forward as model, panels, quant
from jaxinfer.model.panel_tensors import QuantPanelTensor, quant_dense, quant_take
from kernels_cpu import quant_matmul

Q = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(not quant_matmul.available(), reason="the CPU quantized-matmul kernel could not be built")


def _table(fmt: str, rows: int, width: int = 256) -> tuple[np.ndarray, int]:
    """uint8 [rows, row bytes]: gguf-py's `fmt` blocks of seeded normal values."""
    values = np.random.default_rng(3).standard_normal((rows, width)).astype(np.float32)
    return gguf.quants.quantize(values, Q[fmt]), int(Q[fmt])


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
def test_rows_gathered_from_quant_panels_equal_gguf_dequantize_bit_for_bit(fmt):
    data, gguf_type = _table(fmt, 250)  # 250 entries: the last panel is part padding
    w = kept_blocks.quant_panels_by_rows(quant.from_gguf(data, gguf_type, layout="out_in"))
    expected = gguf.quants.dequantize(data, gguf_type).astype(np.float32)  # [V, D]
    tokens = np.array([[0, 249, 17, 17, 31], [32, 5, 240, 248, 100]], np.int32)
    rows = np.asarray(jax.jit(quant_take)(w, tokens))
    assert rows.shape == (2, 5, 256) and w.shape == (250, 256) and w.format == fmt.lower()
    np.testing.assert_array_equal(rows, expected[tokens])
    np.testing.assert_array_equal(np.asarray(quant_dense(w)), expected)  # the whole table, as dense_params reads it: [V, D]


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_packing_by_rows_gives_the_whole_tables_panels(fmt):
    data, gguf_type = _table(fmt, 2 * panels.PACK_ROWS + 250, width=64)  # three chunks, the last one short
    q = quant.from_gguf(data, gguf_type, layout="out_in")
    by_rows, whole = kept_blocks.quant_panels_by_rows(q), panels.to_quant_panels(q)
    assert by_rows.layout == "out_in" and by_rows.out_shape == whole.out_shape
    for got, expected in zip(jax.tree.leaves(by_rows), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def _gemma_q8_0(tmp_path):
    return gemma_gguf(FIXTURES / "tiny_gemma3", tmp_path / "gemma3_q8_0.gguf", qtype=Q.Q8_0)


def test_tied_q8_0_embedding_loads_once_as_the_heads_panels(tmp_path):
    cfg, params = loading.load_model(_gemma_q8_0(tmp_path), quantization="gguf", kquant_panels=True)
    assert cfg.tie_embeddings and params.lm_head is None
    assert isinstance(params.embed, QuantPanelTensor) and params.embed.layout == "out_in" and params.embed.shape == (cfg.vocab_size, cfg.embed_dim)
    packed = panels.pack_panels(params, quantized=True)
    assert packed.lm_head is None and packed.embed.read == "kernel"
    assert all(a is b for a, b in zip(jax.tree.leaves(packed.embed), jax.tree.leaves(params.embed), strict=True))  # the same buffers


def _two_copies(path, params):
    """The previous layout: the embedding's stored blocks (loaded without panels), the head packed from them by pack_panels."""
    _, unpacked = loading.load_model(path, quantization="gguf")
    assert isinstance(unpacked.embed, quant.QuantizedTensor) and unpacked.embed.format == "q8_0"
    return dataclasses.replace(params, embed=unpacked.embed)


def _logits(params, cfg, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return np.asarray(jax.jit(lambda p, t, s: model.forward(p, None, t, s, cfg=cfg)[0])(params, tokens, positions))


@pytest.mark.parametrize("read", ["dense", pytest.param("kernel", marks=needs_kernel)])
def test_logits_with_one_q8_0_copy_equal_the_two_copy_layout(tmp_path, read):
    path = _gemma_q8_0(tmp_path)
    cfg, params = loading.load_model(path, quantization="gguf", kquant_panels=True)
    old = _two_copies(path, params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    if read == "kernel":
        one, two = panels.pack_panels(params, quantized=True), panels.pack_panels(old, quantized=True)
        assert isinstance(two.lm_head, QuantPanelTensor)  # the old path packed a second copy for the head
        got, expected = _logits(one, cfg, tokens), _logits(two, cfg, tokens)
        np.testing.assert_array_equal(got, expected)
    else:
        got, expected = _logits(panels.with_read(params, "dense"), cfg, tokens), _logits(old, cfg, tokens)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0


def test_dense_params_of_a_table_kept_once_are_the_stored_values(tmp_path):
    from jaxinfer.model.params import dense_params

    path = _gemma_q8_0(tmp_path)
    _, params = loading.load_model(path, quantization="gguf", kquant_panels=True)
    _, unpacked = loading.load_model(path, quantization="gguf")
    np.testing.assert_array_equal(np.asarray(dense_params(params).embed), np.asarray(quant.dequantize(unpacked.embed)))


@needs_kernel
def test_w8a8_reference_of_a_tied_q8_0_table_kept_once_matches_the_kernel(tmp_path):
    """The kernels' exact reference (w8a8_exact.with_fake_quant) reads the one-copy table as the [D, V] head."""
    from jaxinfer.model import w8a8_exact

    cfg, params = loading.load_model(_gemma_q8_0(tmp_path), quantization="gguf", kquant_panels=True)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    kernel = _logits(panels.pack_panels(params, quantized=True), cfg, tokens)
    reference = _logits(w8a8_exact.with_fake_quant(params), cfg, tokens)
    assert np.linalg.norm(kernel - reference) / np.linalg.norm(reference) < 1e-5
