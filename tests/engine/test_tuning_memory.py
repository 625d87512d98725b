"""The tuner's f32 reference reads a quantized head a slice of the vocabulary at a time, and never holds the head
whole in f32: its logits against a float64 numpy computation from the file's own blocks (gguf.quants), and its
peak host memory, measured in a child process, against the size of the dense head it must not make."""

import json
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest

from conftest import FIXTURES
from jaxinfer.engine import tuning
from jaxinfer.loading import loading
from jaxinfer.model import panels, quant
from jaxinfer.model.panel_tensors import KQuantPanelTensor

SOURCE = FIXTURES / "kquant" / "q6_k.gguf"  # D = 256, vocabulary 256, an untied Q6_K head


def _copy_gguf(path, *, tied: bool, embed_rows: np.ndarray | None = None) -> None:
    """SOURCE rewritten to `path`: without output.weight when `tied`; with `embed_rows` (raw Q6_K rows) as token_embd."""
    source = gguf.GGUFReader(str(SOURCE))
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in source.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in source.tensors:
        if tied and t.name == "output.weight":
            continue
        data = embed_rows if t.name == "token_embd.weight" and embed_rows is not None else np.asarray(t.data)
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _float64_logits(path, hidden: np.ndarray, eps: float) -> np.ndarray:
    """[R, V]: rms_norm(hidden) @ head.T in float64, the head and norm dequantized by gguf.quants from the file."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    table = gguf.quants.dequantize(head.data, head.tensor_type).astype(np.float64)  # [V, D]
    norm = np.asarray(tensors["output_norm.weight"].data, np.float64)
    x = hidden.astype(np.float64)
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * norm
    return x @ table.T


@pytest.mark.parametrize("tied", [False, True])
def test_reference_logits_by_vocabulary_slices_match_float64_logits_of_the_whole_head(tmp_path, tied):
    path = tmp_path / "model.gguf"
    _copy_gguf(path, tied=tied)
    cfg, params = loading.load_model(path, quantization="gguf", kquant_panels=True)
    head = params.embed if tied else params.lm_head
    assert isinstance(head, KQuantPanelTensor) and head.layout == ("out_in" if tied else "in_out")  # a tied table is the head's panels
    hidden = np.random.default_rng(0).standard_normal((3, 1, cfg.embed_dim)).astype(np.float32)
    cfg32, params32 = tuning.cast_model(cfg, panels.with_read(params, "dense"), "float32")
    got = tuning.reference_logits(params32, jax.numpy.asarray(hidden), cfg32, rows=96)  # slices of 96, 96 and 64
    expected = _float64_logits(path, hidden[:, 0], cfg.rms_norm_eps)
    error = np.abs(got - expected)
    assert error.max() <= 1e-5 * np.abs(expected).max(), f"max {error.max():.3g}, mean {error.mean():.3g}"


def test_packing_a_head_in_place_by_rows_equals_packing_it_whole(monkeypatch):
    cfg, params = loading.load_model(SOURCE, quantization="gguf")
    fields = quant.array_fields(params.embed)  # the [256, D] Q6_K table
    whole = panels._kquant_pack("q6_k", fields)
    monkeypatch.setattr(panels, "PACK_ROWS", 96)  # slices of 96, 96 and 64 rows
    by_rows = panels._kquant_pack_by_rows("q6_k", fields)
    assert by_rows.keys() == whole.keys()
    for name in whole:
        np.testing.assert_array_equal(np.asarray(by_rows[name]), np.asarray(whole[name]), err_msg=name)


CHILD = r"""
import json, sys
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmHWM", "VmRSS")}
from jaxinfer.engine import tuning
from jaxinfer.loading import loading
cfg, params = loading.load_model(sys.argv[1], quantization="gguf", kquant_panels=True)
tuning.REFERENCE_HEAD_ROWS = int(sys.argv[2])
tuning.EXPANSION_SLACK_BYTES = 0  # as for any real model of 1B and up: its dense copy does not fit (tuning.dense_fits)
prompts = [[1 + (7 * i + j) % 200 for j in range(12)] for i in range(2)]
tuning.reference_run(cfg, params, prompts[:1], num_tokens=1)  # the programs compiled, the runtime's pools warm
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
before = status()
tuning.reference_run(cfg, params, prompts, num_tokens=2)
print(json.dumps({"before": before["VmRSS"], "peak": status()["VmHWM"]}))
"""


def test_reference_run_peak_memory_stays_far_below_a_dense_f32_head(tmp_path):
    """A tied Q6_K head of 262144 x 256 (55 MB of blocks, 256 MiB in f32): the reference run's peak above the
    loaded model stays under a third of the dense head (it dequantizes 8192 rows, 8 MiB, at a time). Measured on
    a loaded 2-core EPYC: 37 MiB; 343 MiB with the earlier reference (a second, packed copy of the head dequantized
    by columns inside one program)."""
    num_rows, block_bytes = 2**18, 210  # Q6_K: 210 bytes per 256 weights, one block per row here (D = 256)
    rows = np.random.default_rng(1).integers(0, 256, (num_rows, block_bytes), dtype=np.uint8)
    rows[:, 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # each block's d: a finite fp16
    path = tmp_path / "wide_head.gguf"
    _copy_gguf(path, tied=True, embed_rows=rows)
    dense_head = num_rows * 256 * 4
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), str(tuning.REFERENCE_HEAD_ROWS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    growth = measured["peak"] - measured["before"]
    assert growth < dense_head / 3, f"the reference run peaked {growth / 2**20:.0f} MiB above the loaded model; the dense head is {dense_head / 2**20:.0f} MiB"


def test_a_big_models_probe_cuts_its_prompts_but_keeps_its_programs():
    """make_probe's max_prompt_tokens (tune gives BIG_MODEL_PROMPT_TOKENS where the dense f32 weights exceed
    EXPANSION_SLACK_BYTES): shorter prompts, the same engine config, so the same programs are timed."""
    from jaxinfer.config import EngineConfig

    engine_cfg = EngineConfig(max_context=256, page_size=16, max_num_seqs=4, max_prefill_tokens=256, num_pages=65)
    full = tuning.make_probe(engine_cfg, list(range(1, 300)))
    cut = tuning.make_probe(engine_cfg, list(range(1, 300)), max_prompt_tokens=tuning.BIG_MODEL_PROMPT_TOKENS)
    assert cut.engine_cfg == full.engine_cfg and cut.engine_cfg.compile_threads == 1  # one program compiled at a time: one compile's memory
    assert len(cut.prompts) == len(full.prompts) and len(full.prompts[0]) > tuning.BIG_MODEL_PROMPT_TOKENS
    assert [len(p) for p in cut.prompts] == [tuning.BIG_MODEL_PROMPT_TOKENS] * len(full.prompts)


def test_the_tuner_leaves_none_of_its_programs_compiled(tiny_chat_model, compile_cache):
    """tune() drops jax's caches before the chosen engine is built: the f32 reference's head program (compiled by
    every reference run, as the check below shows first) is gone after it, with the candidates' traces. On the
    Gemma-3-1B-shaped Q4_K_M they held 104 MiB resident through warm-up and serving."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.backends import Impls

    cfg, params = loading.load_model(tiny_chat_model)
    engine_cfg = EngineConfig(compilation_cache_dir=compile_cache, max_context=128, page_size=16, max_num_seqs=4, max_prefill_tokens=64)
    tuning.reference_run(cfg, params, [[1, 2, 3]], num_tokens=1)
    assert tuning._head_logits._cache_size() >= 1  # private, as jax's own api_test uses it
    result = tuning.tune(cfg, params, engine_cfg, Impls(attention_impl="reference"), candidates=[tuning.Candidate("float32", "reference", "xla")])
    assert result.measurements[0].passed
    assert tuning._head_logits._cache_size() == 0
