"""A tied Q8_0 / Q4_0 / Q4_1 embedding is kept once: as the head's quantized panels (loading/kept_blocks.py,
panel_tensors.QuantPanelTensor layout "out_in"), which the lookup also reads (panel_tensors.quant_take: each token's
column gathered from its panel, only those rows dequantized). Gemma 3's Q4_K_M files keep such a Q8_0 table.

- The gathered rows, and the whole table as dense_params reads it, are gguf.quants.dequantize's values bit for bit
  (an independent dequantizer), on a vocabulary that ends inside a panel; the row-chunked packing at load gives the
  arrays panels.to_quant_panels gives whole.
- A tied Gemma 3 Q8_0 file loads with its embedding as panels and no head; pack_panels adds no copy; dense_params
  reads the stored values.
- Its logits (equal to the two-copy layout's, through the kernel and the dense read; the W8A8 exact reference
  against the kernel) are tested with the K-quant tables' in test_tied_embedding_panels.py.
"""

import gguf
import jax
import numpy as np
import pytest

from conftest import FIXTURES
from gemma_gguf import gemma_gguf
from jaxinfer.loading import kept_blocks, loading
from jaxinfer.model import panels, quant
from jaxinfer.model.panel_tensors import QuantPanelTensor, quant_dense, quant_take

Q = gguf.GGMLQuantizationType


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


def test_dense_params_of_a_table_kept_once_are_the_stored_values(tmp_path):
    from jaxinfer.model.params import dense_params

    path = _gemma_q8_0(tmp_path)
    _, params = loading.load_model(path, quantization="gguf", kquant_panels=True)
    _, unpacked = loading.load_model(path, quantization="gguf")
    np.testing.assert_array_equal(np.asarray(dense_params(params).embed), np.asarray(quant.dequantize(unpacked.embed)))
