"""A tied K-quant embedding is kept once: as the head's K-quant panels (loading/kept_blocks.py), which the lookup
also reads (panel_tensors.kquant_take: each token's column gathered, only those rows dequantized).

- The gathered rows are gguf.quants.dequantize's values of those rows bit for bit (an independent dequantizer),
  for every format the panels hold (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1), on a vocabulary that ends inside a panel.
- A tied file loads with its embedding as panels and no head; the engine's packing (pack_panels) adds no copy.
- The logits of the one-copy params equal those of the two-copy ones (the embedding's blocks for the lookup plus
  the head packed from them, the previous layout), through the kernel and through the exact dense read, for a
  Llama with a Q4_K and a Q6_K table and a Gemma 3 (embedding scaled by sqrt(D), logits soft-capped) with Q5_0;
  also for a Gemma 3 with Q8_0 (kept once as the quantized kernel's panels: test_tied_quant_panels.py), whose
  dense read agrees to f32 rounding. The W8A8 exact reference of the one-copy Q6_K and Q8_0 params matches the kernel.
"""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
import gguf_files
from gemma_gguf import gemma_gguf
from jaxinfer.loading import loading
from jaxinfer.model import forward as model, panels, quant
from jaxinfer.model.panel_tensors import KQuantPanelTensor, QuantPanelTensor, kquant_dense, kquant_take
from kernels_cpu import kquant_matmul, quant_matmul

KQUANT = FIXTURES / "kquant"
Q = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(not kquant_matmul.available(), reason="the CPU K-quant kernel could not be built")
needs_quant_kernel = pytest.mark.skipif(not quant_matmul.available(), reason="the CPU quantized-matmul kernel could not be built")


def _stored(file: str, name: str):
    tensor = {t.name: t for t in gguf.GGUFReader(str(KQUANT / f"{file}.gguf")).tensors}[name]
    return np.asarray(tensor.data), int(tensor.tensor_type)


def _blocks(fmt: str) -> tuple[np.ndarray, int]:
    """uint8 [V, row bytes] of a table in `fmt`: llama.cpp's own K-quant blocks from the test files, gguf-py's Q5_0 / Q5_1."""
    if fmt in ("Q5_0", "Q5_1"):
        values = np.random.default_rng(3).standard_normal((256, 256)).astype(np.float32)
        return gguf.quants.quantize(values, Q[fmt]), int(Q[fmt])
    return {"Q4_K": lambda: _stored("q4_k_m", "token_embd.weight"), "Q5_K": lambda: _stored("q5_k_m", "token_embd.weight"),
            "Q6_K": lambda: _stored("q6_k", "output.weight")}[fmt]()


def _embedding_panels(data: np.ndarray, gguf_type: int) -> KQuantPanelTensor:
    q = quant.from_gguf(data, gguf_type, layout="out_in")
    return dataclasses.replace(panels.to_kquant_panels(q), layout="out_in")


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"])
def test_rows_gathered_from_panels_equal_gguf_dequantize_bit_for_bit(fmt):
    data, gguf_type = _blocks(fmt)
    data = data[:250]  # 250 entries: the last panel is part padding
    w = _embedding_panels(data, gguf_type)
    expected = gguf.quants.dequantize(data, gguf_type).astype(np.float32)  # [V, D]
    tokens = np.array([[0, 249, 17, 17, 31], [32, 5, 240, 248, 100]], np.int32)
    rows = np.asarray(jax.jit(kquant_take)(w, tokens))
    assert rows.shape == (2, 5, 256) and w.shape == (250, 256)
    np.testing.assert_array_equal(rows, expected[tokens])
    np.testing.assert_array_equal(np.asarray(kquant_dense(w)), expected)  # the whole table, as dense_params reads it: [V, D]


def _tied_copy(source: str, path, embedding: str):
    """`source` (a test K-quant file) written again without output.weight (so its head is tied), its
    token_embd.weight replaced by the stored tensor `embedding` (the same [V, D] bytes as stored)."""
    reader = gguf.GGUFReader(str(KQUANT / f"{source}.gguf"))
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.name == "output.weight":
            continue
        stored = tensors[embedding] if t.name == "token_embd.weight" else t
        writer.add_tensor(t.name, np.asarray(stored.data), raw_dtype=stored.tensor_type)
    gguf_files.finish(writer)
    return path


def _file(tmp_path, name: str):
    """The tied test file `name`, only that one written: a Llama with a K-quant table, or a Gemma 3 in one format."""
    if name.startswith("gemma3_"):
        return gemma_gguf(FIXTURES / "tiny_gemma3", tmp_path / f"{name}.gguf", qtype=Q[name.removeprefix("gemma3_").upper()])
    source, embedding = {"llama_q4_k": ("q4_k_m", "token_embd.weight"), "llama_q6_k": ("q6_k", "output.weight")}[name]
    return _tied_copy(source, tmp_path / f"tied_{name}.gguf", embedding)


# The tables kept once: K-quant panels, or the quantized kernel's panels for Q8_0 (Gemma 3's Q4_K_M files keep such
# a table; its loading and its Q4_0 / Q4_1 siblings are tested in test_tied_quant_panels.py).
PANELS = {"llama_q4_k": KQuantPanelTensor, "llama_q6_k": KQuantPanelTensor, "gemma3_q5_0": KQuantPanelTensor, "gemma3_q8_0": QuantPanelTensor}


@pytest.mark.parametrize("name", ["llama_q4_k", "llama_q6_k", "gemma3_q5_0"])
def test_tied_embedding_loads_once_as_the_heads_panels(tmp_path, name):
    path = _file(tmp_path, name)
    cfg, params = loading.load_model(path, quantization="gguf", kquant_panels=True)
    assert cfg.tie_embeddings and params.lm_head is None
    assert isinstance(params.embed, KQuantPanelTensor) and params.embed.layout == "out_in" and params.embed.shape == (cfg.vocab_size, cfg.embed_dim)
    packed = panels.pack_panels(params, quantized=True)
    assert packed.lm_head is None and packed.embed.read == "kernel"
    assert all(a is b for a, b in zip(jax.tree.leaves(packed.embed), jax.tree.leaves(params.embed)))  # the same buffers
    assert quant.resident_bytes(packed) == quant.resident_bytes(params)


def _two_copies(path, params, name: str):
    """The previous layout: the embedding's stored blocks for the lookup (loaded without panels) beside them."""
    _, unpacked = loading.load_model(path, quantization="gguf")
    assert isinstance(unpacked.embed, quant.QuantizedTensor) and unpacked.embed.format == name.split("_", 1)[1]  # llama_q4_k: q4_k
    return dataclasses.replace(params, embed=unpacked.embed)


def _logits(params, cfg, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return np.asarray(jax.jit(lambda p, t, s: model.forward(p, None, t, s, cfg=cfg)[0])(params, tokens, positions))


@pytest.mark.parametrize("read", ["dense", "kernel"])
@pytest.mark.parametrize("name", ["llama_q4_k", "llama_q6_k", "gemma3_q5_0", "gemma3_q8_0"])
def test_logits_with_one_copy_equal_the_two_copy_layout(tmp_path, name, read):
    if read == "kernel" and not (quant_matmul if name == "gemma3_q8_0" else kquant_matmul).available():
        pytest.skip("the CPU kernel of this table's format could not be built")
    path = _file(tmp_path, name)
    cfg, params = loading.load_model(path, quantization="gguf", kquant_panels=True)
    assert isinstance(params.embed, PANELS[name])
    old = _two_copies(path, params, name)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    if read == "kernel":
        one, two = panels.pack_panels(params, quantized=True), panels.pack_panels(old, quantized=True)
        assert isinstance(two.lm_head, PANELS[name])  # the old path packed a second copy for the head
    else:
        one, two = panels.with_read(params, "dense"), panels.with_packed_head(panels.with_read(old, "dense"))
    got, expected = _logits(one, cfg, tokens), _logits(two, cfg, tokens)
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    if read == "dense" and name == "gemma3_q8_0":  # with_packed_head gives a K-quant head only: the stored Q8_0 blocks' head sums in another order
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    else:
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("name", [pytest.param("llama_q6_k", marks=needs_kernel), pytest.param("gemma3_q8_0", marks=needs_quant_kernel)])
def test_w8a8_reference_of_a_tied_table_kept_once_matches_the_kernel(tmp_path, name):
    """The kernels' exact reference (w8a8_exact.with_fake_quant) reads the one-copy table as the [D, V] head: on the
    same hidden states the kernel's head and the reference's agree to float rounding, and so does every layer matmul
    (kernel_matmul_error). Whole-model logits are not compared this tightly: an 8-bit activation that rounds the other
    way on one machine's float order moves them by about 1% (a Sapphire Rapids host did, on this very file)."""
    from jaxinfer.model import w8a8_exact

    path = _file(tmp_path, name)
    cfg, params = loading.load_model(path, quantization="gguf", kquant_panels=True)
    packed = panels.pack_panels(params, quantized=True)
    hidden = jnp.asarray(np.random.default_rng(1).normal(size=(2, 9, cfg.embed_dim)), jnp.float32)  # [B, T, D]
    kernel = np.asarray(model.logits_from_hidden(packed, hidden, cfg))  # [B, T, V]
    reference = np.asarray(model.logits_from_hidden(w8a8_exact.with_fake_quant(params), hidden, cfg))
    assert np.abs(reference).max() > 0
    assert np.linalg.norm(kernel - reference) / np.linalg.norm(reference) < 1e-5
    assert w8a8_exact.kernel_matmul_error(packed, params) < 1e-5


@pytest.mark.parametrize("name", ["llama_q6_k", "gemma3_q5_0"])
def test_the_kernel_candidate_of_panels_packed_at_load_makes_no_new_weight_arrays(tmp_path, name):
    """tuning.Candidate.extra_bytes (what `too_large` compares with the tuner's memory budget) counts only new arrays:
    pack_panels hands K-quant panels packed at load (the tied table included) through as they are, so the kernel
    candidate of a model whose every matrix is K-quant adds none (the norms are not repacked either)."""
    from jaxinfer.engine import tuning

    cfg, params = loading.load_model(_file(tmp_path, name), quantization="gguf", kquant_panels=True)
    assert quant.resident_bytes(panels.pack_panels(params, quantized=True)) == quant.resident_bytes(params)
    assert tuning.Candidate("float32", "cpu", "cpu_int8").extra_bytes(cfg, params, auto_weights=True) == 0
