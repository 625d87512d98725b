"""Quantized weights through the one forward: GGUF blocks kept, int8 and int4.

- quantization="gguf" keeps SmolLM2's Q4_1 / Q8_0 blocks: the same greedy tokens and logits (within the
  f32 tolerance) as the dense f32 path and the HF fixtures; its resident bytes are the file's.
- int8 / int4: the KL divergence of the next-token distribution from the f32 model's, over the fixture
  prompts, against a bound derived from each format's rounding step (see `format_noise_params`).
- The compiled scanned forward never holds every layer's dequantized weights at once (a control that
  dequantizes before the scan shows the check can fail).
- The engine (LLM.generate) runs with quantization="gguf" and agrees with quantization=None.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES, SMOLLM2_SMALL_ENGINE, padded_logits
from jaxinfer.loading import loading
from jaxinfer.model import params as params_lib, quant
from jaxinfer.engine.generate import generate
from jaxinfer.model.forward import forward
from jaxinfer.scheduling.request import SamplingParams
from jaxinfer.validation import FieldError
from tolerances import LOGITS_VS_FLOAT64, LOGITS_VS_HF_F32, assert_close

SMOLLM2 = np.load(FIXTURES / "smollm2_reference.npz")
PROMPTS = range(int(SMOLLM2["num_prompts"]))
TINY = np.load(FIXTURES / "tiny_llama_reference.npz")
# The KL bound is this many times the KL of the format's own rounding noise (format_noise_params): room
# for one random draw of the noise and for the real error being not quite uniform.
NOISE_MODEL_SLACK = 2.0


def all_logits(cfg, params, sequences: list[np.ndarray]) -> list[np.ndarray]:
    """f32 logits [T, V] of each sequence, one forward each, padded to a bucket so compiles stay few."""
    return padded_logits(cfg, params, sequences)


def mean_kl(reference: list[np.ndarray], other: list[np.ndarray]) -> float:
    """Mean over every position of every sequence of KL(p_reference || p_other), in nats (f64)."""
    total, count = 0.0, 0
    for a, b in zip(reference, other):
        log_p = jax.nn.log_softmax(np.asarray(a, np.float64), axis=-1)
        log_q = jax.nn.log_softmax(np.asarray(b, np.float64), axis=-1)
        total += float(np.sum(np.exp(log_p) * (log_p - log_q)))
        count += a.shape[0]
    return total / count


def _rounding_steps(field: str, w: np.ndarray, fmt: str, group_size: int) -> np.ndarray:
    """The step s of every element of a dense weight (Params layout) under `fmt`, from the format's
    spec and the dense values alone: int8 max|row| / 127 per output channel, int4 max|group| / 7."""
    lead = 0 if field in ("embed", "lm_head") else 1
    if field == "embed":  # [V, D]: rows are output channels already
        rows = w
    else:
        num_in = params_lib.weight_spec(field).num_in
        in_size = math.prod(w.shape[lead : lead + num_in])
        rows = np.swapaxes(w.reshape(*w.shape[:lead], in_size, -1), -1, -2)  # [*lead, O, I]
    width = rows.shape[-1] if fmt == "int8" else group_size
    groups = np.abs(rows).reshape(*rows.shape[:-1], -1, width)
    step = np.broadcast_to(groups.max(-1, keepdims=True) / (127 if fmt == "int8" else 7), groups.shape).reshape(rows.shape)
    if field == "embed":
        return step
    return np.swapaxes(step, -1, -2).reshape(w.shape)


def format_noise_params(dense: params_lib.Params, quantization: str, *, group_size: int = 32, seed: int = 0) -> params_lib.Params:
    """The dense weights plus independent uniform noise U(-s/2, s/2), s the format's rounding step.

    Derivation of the KL bound. Round-to-nearest with step s makes an error within +-s/2 that is, to a
    good approximation (Widrow's quantization-noise model), uniform and independent of the weight and of
    the activations. KL(p || q) is to second order half the variance under p of the logit change, which
    for uncorrelated errors depends only on each element's error variance (s^2 / 12). So this model's KL
    is what an unbiased quantizer of that step must cost; built from the dense weights and the format
    alone, it does not see the quantized model under test. A quantized KL above NOISE_MODEL_SLACK x it
    means systematic error: a wrong scale, layout, permutation or a weight applied on the wrong axis.
    """
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    fields = {"embed": dense.embed, "lm_head": dense.lm_head} | {f.name: getattr(dense.layers, f.name) for f in dataclasses.fields(dense.layers)}
    noised = {}
    for field, w in fields.items():
        fmt = params_lib.weight_format(field, quantization)
        if w is None or fmt is None:
            continue
        w = np.asarray(w, np.float32)
        step = _rounding_steps(field, w, fmt, group_size)
        noise = np.asarray(jax.random.uniform(next(keys), w.shape, jnp.float32, -0.5, 0.5))
        noised[field] = jnp.asarray(w + noise * step)
    layers = dataclasses.replace(dense.layers, **{k: v for k, v in noised.items() if k not in ("embed", "lm_head")})
    return dataclasses.replace(dense, layers=layers, **{k: v for k, v in noised.items() if k in ("embed", "lm_head")})


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smollm2_gguf():
    return loading.load_model(None, dtype="float32", max_context=2048, quantization="gguf")


@pytest.fixture(scope="module")
def smollm2_sequences():
    return [SMOLLM2[f"p{i}_ids"].astype(np.int32) for i in PROMPTS]


@pytest.fixture(scope="module")
def smollm2_f32_logits(smollm2_fixture_logits):
    return smollm2_fixture_logits  # all_logits(*smollm2, smollm2_sequences), computed once a session (conftest)


# ---------------------------------------------------------------- the choice of formats and the boundary


def test_weight_format_owns_the_choice():
    assert params_lib.weight_format("attn_norm", "int4") is None and params_lib.weight_format("bq", "int8") is None
    assert params_lib.weight_format("wq", "int4") == "int4" and params_lib.weight_format("w_down", "gguf") == "gguf"
    assert params_lib.weight_format("embed", "int4") == "int8" and params_lib.weight_format("lm_head", "int4") == "int8"
    assert params_lib.weight_format("wo", None) is None


def test_dense_qeinsum_and_take_lower_to_todays_ops():
    """Dense weights keep today's numbers bit for bit: the same HLO as jnp.einsum and w[tokens]."""
    x, w, table, ids = jnp.ones((2, 3, 8)), jnp.ones((8, 2, 4)), jnp.ones((16, 8)), jnp.zeros((2, 3), jnp.int32)

    def today(x, w, table, ids):
        return jnp.einsum("btd,dhk->bthk", x, w), jnp.einsum("btd,vd->btv", x, table, preferred_element_type=jnp.float32), table[ids]

    def through_quant(x, w, table, ids):
        return quant.qeinsum("btd,dhk->bthk", x, w), quant.qeinsum("btd,vd->btv", x, table, preferred_element_type=jnp.float32), quant.take(table, ids)

    text = lambda f: jax.jit(f).lower(x, w, table, ids).as_text().replace(f.__name__, "f")  # noqa: E731
    assert text(today) == text(through_quant)


def test_llm_rejects_unknown_quantization_naming_the_field():
    from jaxinfer.api import LLM

    with pytest.raises(FieldError, match="quantization") as info:
        LLM(FIXTURES / "tiny_llama", quantization="int3", warmup=False)
    assert info.value.field == "quantization"


def test_gguf_quantization_of_a_hf_folder_is_a_clear_error():
    with pytest.raises(loading.ModelLoadError, match="Hugging Face folder"):
        loading.load_model(FIXTURES / "tiny_llama", quantization="gguf")


def test_int4_group_that_does_not_divide_a_width_names_the_tensor():
    with pytest.raises(ValueError, match=r"'w_down' \(3, 160, 64\).*group size 64"):  # F = 160
        loading.load_model(FIXTURES / "tiny_llama", quantization="int4", group_size=64)


# ---------------------------------------------------------------- GGUF blocks kept


def test_gguf_kept_smollm2_holds_the_files_blocks_within_15_percent(smollm2_gguf):
    cfg, params = smollm2_gguf
    assert isinstance(params.embed, quant.QuantizedTensor) and params.embed.format == "q8_0"
    assert all(getattr(params.layers, f).format == "q4_1" for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    reader = loading.open_gguf(loading.default_model_path())
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    resident = quant.resident_bytes(params)
    print(f"SmolLM2 gguf-kept: resident {resident:,} bytes, file tensors {file_bytes:,}")  # pytest -s
    assert abs(resident - file_bytes) <= 0.15 * file_bytes, f"resident {resident} vs file tensors {file_bytes}"
    dense = 4 * cfg.num_params()
    assert resident < dense / 5, f"kept {resident} bytes, f32 {dense}"


def test_gguf_kept_logits_match_f32_path_and_hf(smollm2_gguf, smollm2_f32_logits, smollm2_sequences):
    ours = all_logits(*smollm2_gguf, smollm2_sequences)
    for i, (kept, dense) in enumerate(zip(ours, smollm2_f32_logits)):
        # the weights are bit-identical; only the dot's summation order may differ
        assert_close(kept, dense, LOGITS_VS_FLOAT64, f"prompt {i}: gguf-kept vs f32 logits")
        assert_close(kept[-1], SMOLLM2[f"p{i}_last_logits"], LOGITS_VS_HF_F32, f"prompt {i}: gguf-kept vs HF last logits")


@pytest.mark.slow
def test_gguf_kept_greedy_tokens_equal_the_f32_path(smollm2_gguf):
    cfg, params = smollm2_gguf
    chosen = (0, 5, 8)  # short, the 601-token one, a single token; the logits test covers every prompt
    prompts = [SMOLLM2[f"p{i}_ids"].tolist() for i in chosen]
    outputs = generate(params, cfg, prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for i, out in zip(chosen, outputs):
        assert out.token_ids == SMOLLM2[f"p{i}_greedy_ids"].tolist(), f"prompt {i}"


def test_gguf_kept_tiny_llama_q8_0_undoes_the_rotary_permutation(tmp_path, tiny_llama):
    """llama.cpp permutes Q/K rows; kept blocks must be un-permuted like the dense path (4 heads, 2 kv)."""
    import gguf
    import gguf_convert

    path = gguf_convert.convert(FIXTURES / "tiny_llama", tmp_path / "tiny_q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    dense_cfg, dense = loading.load_model(path)
    cfg, kept = loading.load_model(path, quantization="gguf")
    assert kept.layers.wq.format == "q8_0" and kept.lm_head.format == "q8_0" and kept.lm_head.shape == (64, 512)
    for s in range(int(TINY["num_sequences"])):
        ids = [TINY[f"s{s}_ids"].astype(np.int32)]
        assert_close(all_logits(cfg, kept, ids)[0], all_logits(dense_cfg, dense, ids)[0], LOGITS_VS_FLOAT64, f"sequence {s}")


# ---------------------------------------------------------------- the scanned forward expands one layer at a time


def _f32_stack_bytes(cfg) -> tuple[int, int]:
    """(bytes of one layer's matmul weights in f32, of all layers') from the config's shapes."""
    matrices = [spec for spec in params_lib.present(cfg) if spec.stacked and spec.num_in]
    one = 4 * sum(math.prod(spec.layer_shape(cfg)) for spec in matrices)
    return one, one * cfg.num_layers


def _stacked_f32_buffers(hlo: str, num_layers: int, min_elements: int) -> list[str]:
    """f32 arrays in the optimized HLO with a leading layer axis and at least one layer weight's size."""
    found = []
    for dims in re.findall(rf"f32\[{num_layers},([\d,]+)\]", hlo):
        if math.prod(int(d) for d in dims.split(",")) >= min_elements:
            found.append(f"f32[{num_layers},{dims}]")
    return found


def test_compiled_gguf_forward_never_holds_every_layers_f32_weights(smollm2_gguf):
    cfg, params = smollm2_gguf
    ids = jnp.zeros((1, 16), jnp.int32)
    positions = jnp.arange(16, dtype=jnp.int32)[None]
    one_layer, all_layers = _f32_stack_bytes(cfg)
    smallest = min(math.prod(spec.layer_shape(cfg)) for spec in params_lib.present(cfg) if spec.stacked and spec.num_in)

    def scanned(p, t, pos):
        return forward(p, None, t, pos, cfg=cfg)[0]

    def dequantized_first(p, t, pos):  # the control: every layer expanded before the scan
        expand = lambda w: quant.dequantize(w) if isinstance(w, quant.QuantizedTensor) else w  # noqa: E731
        layers = jax.tree.map(expand, p.layers, is_leaf=lambda x: isinstance(x, quant.QuantizedTensor))
        return forward(dataclasses.replace(p, layers=layers), None, t, pos, cfg=cfg)[0]

    compiled = jax.jit(scanned).lower(params, ids, positions).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    head = 4 * cfg.vocab_size * cfg.embed_dim  # the tied head's table, dequantized once per step
    assert temp < head + 3 * one_layer, f"temp {temp / 2**20:.1f} MiB; one layer {one_layer / 2**20:.1f}, all {all_layers / 2**20:.1f} MiB"
    assert not _stacked_f32_buffers(compiled.as_text(), cfg.num_layers, smallest)

    control = jax.jit(dequantized_first).lower(params, ids, positions).compile()
    print(f"temp bytes: scanned {temp:,}, dequantized before the scan {control.memory_analysis().temp_size_in_bytes:,}, f32 layers {all_layers:,}")
    assert control.memory_analysis().temp_size_in_bytes >= all_layers
    assert _stacked_f32_buffers(control.as_text(), cfg.num_layers, smallest)


# ---------------------------------------------------------------- int8 / int4: KL against f32


def _kl_check(dense_model, quantized_model, quantization, sequences, f32_logits, what: str) -> tuple[float, float]:
    (cfg, dense), (_, quantized) = dense_model, quantized_model
    kl = mean_kl(f32_logits, all_logits(cfg, quantized, sequences))
    predicted = mean_kl(f32_logits, all_logits(cfg, format_noise_params(dense, quantization), sequences))
    assert kl > 0, f"{what}: the quantized model equals f32, nothing was quantized"
    print(f"{what}: mean KL {kl:.3g} nats, noise model {predicted:.3g}, bound {NOISE_MODEL_SLACK * predicted:.3g}")  # pytest -s
    assert kl <= NOISE_MODEL_SLACK * predicted, f"{what}: KL {kl:.3g} nats > {NOISE_MODEL_SLACK} x noise model {predicted:.3g}"
    return kl, predicted


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tiny_llama_kl_within_the_noise_model_bound(tiny_llama, quantization):
    sequences = [TINY[f"s{s}_ids"].astype(np.int32) for s in range(int(TINY["num_sequences"]))]
    quantized = loading.load_model(FIXTURES / "tiny_llama", quantization=quantization)
    assert quantized[1].layers.wq.format == quantization and quantized[1].lm_head.format == "int8"
    _kl_check(tiny_llama, quantized, quantization, sequences, all_logits(*tiny_llama, sequences), f"tiny llama {quantization}")


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_smollm2_kl_within_the_noise_model_bound(smollm2, smollm2_sequences, smollm2_f32_logits, quantization):
    quantized = loading.load_model(None, dtype="float32", max_context=2048, quantization=quantization)
    _kl_check(smollm2, quantized, quantization, smollm2_sequences, smollm2_f32_logits, f"SmolLM2 {quantization}")


def test_a_systematic_error_breaks_the_noise_model_bound(tiny_llama):
    """The KL check can fail: int8 with wq's heads swapped (a layout bug) is far above its noise model."""
    sequences = [TINY[f"s{s}_ids"].astype(np.int32) for s in range(int(TINY["num_sequences"]))]
    cfg, quantized = loading.load_model(FIXTURES / "tiny_llama", quantization="int8")
    wq = quantized.layers.wq  # codes [N, H * K, D]: swap heads 0 and 1
    order = np.r_[16:32, 0:16, 32:64]
    broken = dataclasses.replace(wq, codes=wq.codes[:, order], scales=wq.scales[:, order])
    broken_model = (cfg, dataclasses.replace(quantized, layers=dataclasses.replace(quantized.layers, wq=broken)))
    with pytest.raises(AssertionError, match="noise model"):
        _kl_check(tiny_llama, broken_model, "int8", sequences, all_logits(*tiny_llama, sequences), "broken int8")


# ---------------------------------------------------------------- the engine and the CLI


@pytest.mark.slow
def test_engine_with_gguf_blocks_gives_the_dense_engines_greedy_tokens(smollm2_llm, compile_cache):
    from jaxinfer.api import LLM

    prompts = ["The capital of France is", "def add(a, b):"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert not isinstance(smollm2_llm.engine.params.layers.w_up, quant.QuantizedTensor)  # the session's dense engine (conftest)
    dense = smollm2_llm.generate(prompts, greedy)
    kept_llm = LLM(None, quantization="gguf", compilation_cache_dir=compile_cache, **SMOLLM2_SMALL_ENGINE)  # the same engine config
    assert kept_llm.engine.params.layers.w_up.format == "q4_1"
    kept = kept_llm.generate(prompts, greedy)
    assert [o.token_ids for o in kept] == [o.token_ids for o in dense]


def test_info_prints_weight_bytes_per_kind_and_format(capsys):
    from jaxinfer import cli

    assert cli.main(["info", "--quantization", "gguf"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.strip().startswith("kind"))
    assert header.split() == ["kind", "float32", "q4_1", "q8_0", "total"], out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert set(rows) >= {"embedding", "attention", "mlp", "head", "total"}, out
    assert rows["embedding"][:3] == ["-", "-", "28.69"], out  # 49152 x 576 Q8_0: 34 bytes per 32 weights
    assert rows["attention"][0] != "-" and rows["attention"][2] != "-", out  # norms f32, projections Q4_1
