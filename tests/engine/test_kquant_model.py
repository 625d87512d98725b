"""K-quant GGUFs (Q4_K_M, Q5_K_M, Q6_K) made by llama.cpp's own quantizer, kept as stored and run through
the CPU K-quant kernel, against llama.cpp's logits and greedy tokens on the same files.

The files and llama.cpp's reference come from tests/reference/make_kquant_files.py (`make kquant-fixtures`,
.venv-ref with llama-cpp-python): a tiny random Llama (3 layers, D 256) whose Q4_K_M / Q5_K_M keep attn_v and
ffn_down in Q6_K in layer 2 and Q4_K / Q5_K in layers 0-1, with a Q6_K head.

- Loading keeps every matrix as stored: the formats per layer are the file's own tensor types, the bytes
  on the device are the file's, and nothing is f32 but the norms.
- Dequantized (read="dense"), the kept panels are gguf.quants.dequantize's values bit for bit (an
  independent dequantizer: the dense load).
- Logits of the kernel path and of the exact-dequantization path against llama.cpp's, within what 8-bit
  activations explain (module constants), and the engine's greedy tokens against llama.cpp's.
"""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from jaxinfer.config import EngineConfig
from jaxinfer.engine import backends
from jaxinfer.engine.engine import Engine
from jaxinfer.loading import loading
from jaxinfer.model import forward as model, panels, params as params_lib, quant
from jaxinfer.model.panel_tensors import KQuantPanelTensor
from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.scheduler import Scheduler
from jaxinfer.scheduling.stopping import OutputProcessor
from kernels_cpu import kquant_matmul

KQUANT = FIXTURES / "kquant"
REFERENCE = np.load(KQUANT / "reference.npz")
FILES = ("q4_k_m", "q5_k_m", "q6_k")
NUM_SEQUENCES = 3
# Relative error norms of the logits against llama.cpp's. llama.cpp multiplies K-quants by activations quantized
# to 8 bits per 256 (q8_K); with the weights dequantized exactly (read="dense") this model measured 3.3-3.8%
# from llama.cpp (and 1.2e-6 on the F32 source file, so the model itself matches): the whole gap is llama.cpp's
# activation rounding. The kernel adds its own 8-bit activations (per 256 for K-quants, as llama.cpp's q8_K): the bound below holds. Bounds: 1.5x.
DENSE_VS_LLAMA_CPP = 0.06
KERNEL_VS_LLAMA_CPP = 0.07
# A difference of two tokens' logits carries both sides' activation noise (about 4% of the logits' RMS each, above):
# sqrt(2) * sqrt(0.04^2 + 0.045^2) = 0.085 RMS per standard deviation; a near-tie is within about 2.4 of them.
NEAR_TIE = 0.2
ENGINE = dict(max_context=64, page_size=16, max_num_seqs=4, max_prefill_tokens=64, prefill_chunk_buckets=(64,),
              prefill_seq_buckets=(1,), decode_batch_buckets=(4,), decode_page_buckets=(4,))

needs_kernel = pytest.mark.skipif(not kquant_matmul.available(), reason="the CPU K-quant kernel could not be built")


def path_of(name: str) -> Path:
    return KQUANT / f"{name}.gguf"


_LOADED = {}


def load_kept(name: str):
    """(cfg, params) of a file kept as stored and packed for the K-quant kernel at load, once per session."""
    if name not in _LOADED:
        _LOADED[name] = loading.load_model(path_of(name), quantization="gguf", kquant_panels=True)
    return _LOADED[name]


def file_types(name: str) -> dict[str, str]:
    """GGUF tensor name -> its type in the file (lower case), as make_kquant_files.py recorded it."""
    return dict(line.lower().split("=") for line in REFERENCE[f"{name}_tensor_types"].tolist())


def logits(cfg, params, ids: np.ndarray) -> np.ndarray:
    tokens = jnp.asarray(ids, jnp.int32)[None]
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    return np.asarray(_forward(params, tokens, positions, cfg=cfg)[0])


_forward = jax.jit(lambda params, tokens, positions, cfg: model.forward(params, None, tokens, positions, cfg=cfg)[0], static_argnames="cfg")


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


@pytest.mark.parametrize("name", FILES)
def test_loads_every_layer_as_stored(name):
    cfg, params = load_kept(name)
    types = file_types(name)
    for spec in params_lib.present(cfg):
        value = getattr(params.layers if spec.stacked else params, spec.name)
        if not spec.num_in:
            continue
        names = spec.file_names(cfg, "gguf")
        if spec.name == "embed":  # the lookup's table stays in its stored fields (quant.take)
            assert isinstance(value, quant.QuantizedTensor) and value.format == types[names[0]]
            continue
        assert isinstance(value, KQuantPanelTensor), (spec.name, type(value))
        assert [value.formats[value.layer_part[i]] for i in range(len(names))] == [types[n] for n in names], spec.name
    wv, w_down = params.layers.wv, params.layers.w_down
    if name != "q6_k":  # Q4_K_M / Q5_K_M: layer 2's attn_v and ffn_down are Q6_K, the others not
        assert len(wv.parts) == 2 and len(w_down.parts) == 2 and wv.formats[wv.layer_part[2]] == "q6_k"
    file_bytes = path_of(name).stat().st_size
    resident = quant.resident_bytes(params)
    assert 0.95 * file_bytes < resident < 1.05 * file_bytes, (resident, file_bytes)
    dense = [leaf for leaf in jax.tree.leaves(params) if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype == jnp.float32]
    assert sum(leaf.size for leaf in dense) <= (2 * cfg.num_layers + 1) * cfg.embed_dim  # the norms only


@pytest.mark.parametrize("name", FILES)
def test_dequantized_panels_equal_gguf_dequantize(name):
    cfg, params = load_kept(name)
    _, dense = loading.load_model(path_of(name))  # every tensor through gguf.quants.dequantize
    ours = params_lib.fields_of(params_lib.dense_params(params))
    for field, expected in params_lib.fields_of(dense).items():
        np.testing.assert_array_equal(np.asarray(ours[field]), np.asarray(expected), err_msg=field)


@needs_kernel
@pytest.mark.parametrize("name", FILES)
def test_logits_match_llama_cpp(name):
    cfg, params = load_kept(name)
    for s in range(NUM_SEQUENCES):
        ids, expected = REFERENCE[f"{name}_s{s}_ids"], REFERENCE[f"{name}_s{s}_logits"]
        dense_error = relative_error(logits(cfg, panels.with_read(params, "dense"), ids), expected)
        kernel_error = relative_error(logits(cfg, panels.with_read(params, "kernel"), ids), expected)
        assert dense_error < DENSE_VS_LLAMA_CPP, (s, dense_error)
        assert kernel_error < KERNEL_VS_LLAMA_CPP, (s, kernel_error)


def greedy_tokens(engine: Engine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy continuations through the real scheduler and engine."""
    engine_cfg = engine.engine_cfg
    scheduler = Scheduler(engine_cfg, engine.num_pages)
    greedy = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        scheduler.add(Request(str(i), list(prompt), greedy, seed=i, arrival_index=i))
    finished = list(runloop.run(scheduler, engine.step, OutputProcessor(None, None, engine_cfg.max_context)))
    assert all(r.finish_reason != "error" for r in finished), [r.error for r in finished]
    return [list(r.output_ids) for r in sorted(finished, key=lambda r: int(r.request_id))]


@needs_kernel
def test_engine_on_the_kernel_agrees_with_llama_cpp_and_keeps_the_loaded_arrays():
    name = "q4_k_m"  # the mixed one
    cfg, params = load_kept(name)
    engine_cfg = EngineConfig(attention_impl="cpu", matmul_impl="cpu_int8", **ENGINE)
    engine = Engine(cfg, params, engine_cfg)
    engine.warmup()
    assert engine.matmul_impl == "cpu_int8"
    # the step params hold the loaded panels themselves: no copy, no expansion
    assert quant.resident_bytes(engine.step_params) == quant.resident_bytes(params)
    assert engine.step_params.layers.w_down.parts[0]["codes"] is params.layers.w_down.parts[0]["codes"]
    prompts = [REFERENCE[f"{name}_s{s}_ids"].tolist() for s in range(NUM_SEQUENCES)]
    ours = greedy_tokens(engine, prompts, 8)
    first_tokens = [int(np.argmax(REFERENCE[f"{name}_s{s}_logits"][-1])) for s in range(NUM_SEQUENCES)]
    assert [tokens[0] for tokens in ours] == first_tokens
    dense = panels.with_read(params, "dense")
    for s, (prompt, mine) in enumerate(zip(prompts, ours)):
        theirs = REFERENCE[f"{name}_s{s}_greedy"].tolist()
        step = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if step is None:
            continue
        # Where the two continuations part, the exactly dequantized model (on llama.cpp's path) must call it a
        # near-tie: the two tokens' logits within NEAR_TIE times the logits' RMS.
        row = logits(cfg, dense, np.asarray(prompt + theirs[:step], np.int32))[-1]
        margin = abs(float(row[theirs[step]] - row[mine[step]]))
        assert margin <= NEAR_TIE * float(np.sqrt(np.mean(row**2))), (s, step, margin)


@needs_kernel
def test_auto_loads_k_quants_packed_where_the_kernel_may_run(monkeypatch):
    """quantization='auto' with tuning on (the default outside tests) keeps a K-quant file's blocks packed for the
    kernel; with tuning off (JAXINFER_TUNE=0: the fixed rule, no W8A8) it loads dense."""
    from jaxinfer.options import LoadOptions

    kinds = {}
    for tune in ("1", "0"):
        monkeypatch.setenv("JAXINFER_TUNE", tune)
        _, params = loading.load_for_engine(path_of("q4_k_m"), LoadOptions(), EngineConfig(**ENGINE))
        kinds[tune] = {type(v).__name__ for v in params_lib.fields_of(params).values()}
    assert "KQuantPanelTensor" in kinds["1"] and "QuantizedTensor" in kinds["1"]  # the embedding stays for the lookup
    assert kinds["0"] == {"ArrayImpl"}


def test_pinned_xla_reads_the_panels_dequantized():
    """Under any impl but 'cpu_int8' the packed weights are multiplied dequantized (read="dense"): the
    engine's step params mark them so, and their logits are the exact-dequantization ones."""
    cfg, params = load_kept("q6_k")
    step = backends.packer("xla")(params)
    assert all(v.read == "dense" for v in params_lib.fields_of(step).values() if isinstance(v, KQuantPanelTensor))
    ids = REFERENCE["q6_k_s0_ids"]
    _, dense = loading.load_model(path_of("q6_k"))
    np.testing.assert_allclose(logits(cfg, step, ids), logits(cfg, dense, ids), rtol=0, atol=1e-4 * math.sqrt(cfg.embed_dim))


def test_a_type_no_kernel_reads_is_converted_not_expanded(tmp_path, capfd):
    """A Q3_K weight (llama.cpp's Q3_K_M files; no kernel reads it) loads as Q4_0 blocks, within one Q4_0 step
    of gguf.quants.dequantize's values per block, with a printed note; never as f32."""
    import gguf

    source = gguf.GGUFReader(str(path_of("q6_k")))
    path = tmp_path / "q3_k_ffn_down.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in source.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    rng = np.random.default_rng(0)
    q3 = gguf.GGMLQuantizationType.Q3_K
    for t in source.tensors:
        if "ffn_down" in t.name:  # random Q3_K blocks with sane fp16 super-scales (the last 2 bytes of each)
            rows, cols = int(t.shape[1]), int(t.shape[0])
            blocks = rng.integers(0, 256, (rows * cols // 256, 110), dtype=np.uint8)
            blocks[:, -2:] = rng.uniform(1e-3, 2e-3, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
            writer.add_tensor(t.name, blocks.reshape(rows, -1), raw_dtype=q3)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg, params = loading.load_model(path, quantization="gguf")
    assert "Q3_K tensor is converted to Q4_0" in capfd.readouterr().err
    w_down = params.layers.w_down
    assert isinstance(w_down, quant.QuantizedTensor) and w_down.format == "q4_0"
    reader = gguf.GGUFReader(str(path))
    for i, t in enumerate(t for t in reader.tensors if "ffn_down" in t.name):
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w_down.codes.shape[1], -1)  # [O, I] rows
        got = np.asarray(quant.dequantize(jax.tree.map(lambda leaf: leaf[i], w_down))).T  # [F, D] -> [O, I]
        step = np.repeat(np.abs(expected).reshape(expected.shape[0], -1, 32).max(-1) / 8, 32, axis=1)  # Q4_0's |d| per block
        assert np.all(np.abs(got - expected) <= step * (1 + 2**-7) + 1e-7)  # a clipped edge: 8 |d| - 7 |fp16(d)|


def test_a_tied_k_quant_head_read_dense_a_chunk_of_columns_at_a_time(tmp_path, monkeypatch):
    """The tuner's f32 reference and non-kernel candidates read a tied K-quant head, kept once as the embedding's
    panels, dequantized PACK_ROWS columns at a time: the same logits as the embedding dequantized whole (no 1 GiB f32
    table per step)."""
    import gguf

    source = gguf.GGUFReader(str(path_of("q6_k")))
    path = tmp_path / "tied_q6_k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in source.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in source.tensors:
        if t.name != "output.weight":  # tied: the Q6_K token_embd is the head
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg, params = loading.load_model(path, quantization="gguf", kquant_panels=True)
    assert cfg.tie_embeddings and params.lm_head is None
    monkeypatch.setattr(panels, "PACK_ROWS", 64)  # 4 chunks of the 256-row table
    chunked = panels.with_read(panels.with_packed_head(params), "dense")
    assert chunked.lm_head is None and isinstance(chunked.embed, KQuantPanelTensor) and chunked.embed.parts[0]["codes"].shape[0] == cfg.vocab_size // 16
    ids = REFERENCE["q6_k_s0_ids"]
    np.testing.assert_allclose(logits(cfg, chunked, ids), logits(cfg, params_lib.dense_params(params), ids), rtol=0, atol=1e-5)
