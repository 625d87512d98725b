"""The forward against independent implementations.

- SmolLM2 Q4_1 GGUF vs Hugging Face transformers (f32, same dequantized weights) through the committed
  fixtures: top-20 logits and logsumexp at every position, the full last-position logits, and 32 greedy
  tokens. The same stored token ids go to both models.
- The tiny random Llama saved by transformers as safetensors: our safetensors loader vs HF's logits.
- A float64 numpy forward written here from the Llama equations, on the tiny model.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from jaxinfer.engine.generate import generate
from jaxinfer.model.forward import forward
from jaxinfer.scheduling.request import SamplingParams
from tolerances import LOGITS_VS_FLOAT64, LOGITS_VS_HF_F32, assert_close

SMOLLM2 = np.load(FIXTURES / "smollm2_reference.npz")
SMOLLM2_META = json.loads((FIXTURES / "smollm2_reference.json").read_text())
PROMPTS = range(int(SMOLLM2["num_prompts"]))
TINY = np.load(FIXTURES / "tiny_llama_reference.npz")


def logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


@pytest.fixture(scope="module")
def smollm2_logits(smollm2_fixture_logits):
    """f32 logits of our forward (no cache) for each fixture prompt, as float64; computed once a session
    (conftest), right-padded to a bucket, which a causal forward never lets an earlier position see."""
    return {i: np.asarray(logits, np.float64) for i, logits in zip(PROMPTS, smollm2_fixture_logits)}


def test_fixtures_cover_at_least_8_prompts_one_over_512_tokens():
    lengths = [len(SMOLLM2[f"p{i}_ids"]) for i in PROMPTS]
    assert len(lengths) >= 8 and max(lengths) > 512


@pytest.mark.parametrize("i", PROMPTS)
def test_top20_logits_match_hf_at_every_position(smollm2_logits, i):
    ours = np.take_along_axis(smollm2_logits[i], SMOLLM2[f"p{i}_top20_indices"].astype(np.int64), axis=-1)
    assert_close(ours, SMOLLM2[f"p{i}_top20_values"], LOGITS_VS_HF_F32, f"prompt {i} top-20 logits")
    assert_close(logsumexp(smollm2_logits[i]), SMOLLM2[f"p{i}_logsumexp"], LOGITS_VS_HF_F32, f"prompt {i} logsumexp")


@pytest.mark.parametrize("i", PROMPTS)
def test_last_position_logits_match_hf(smollm2_logits, i):
    assert_close(smollm2_logits[i][-1], SMOLLM2[f"p{i}_last_logits"], LOGITS_VS_HF_F32, f"prompt {i} last logits")


def test_greedy_32_tokens_match_hf_for_every_prompt(smollm2):
    cfg, params = smollm2
    prompts = [SMOLLM2[f"p{i}_ids"].tolist() for i in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = generate(params, cfg, prompts, greedy)
    for i, out in zip(PROMPTS, outputs):
        assert out.token_ids == SMOLLM2[f"p{i}_greedy_ids"].tolist(), SMOLLM2_META["prompts"][i]["name"]


@pytest.mark.parametrize("s", range(int(TINY["num_sequences"])))
def test_safetensors_tiny_llama_logits_match_hf(tiny_llama, s):
    cfg, params = tiny_llama
    ids = jnp.asarray(TINY[f"s{s}_ids"])[None]
    logits, _ = forward(params, None, ids, jnp.arange(ids.shape[1], dtype=jnp.int32)[None], cfg=cfg)
    assert_close(np.asarray(logits[0]), TINY[f"s{s}_logits"], LOGITS_VS_HF_F32, f"tiny llama sequence {s}")


def test_tiny_llama_config_read_from_hf_config(tiny_llama):
    cfg, _ = tiny_llama
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (3, 4, 2, 16)
    assert cfg.rope_theta == 50000.0 and not cfg.tie_embeddings


# ---------------------------------------------------------------- float64 numpy reference


def numpy_llama_forward(cfg, params, ids: np.ndarray) -> np.ndarray:
    """Llama in float64, written from the equations, one token row at a time, no jax."""
    p = {name: np.asarray(getattr(params.layers, name), np.float64) for name in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")}
    x = np.asarray(params.embed, np.float64)[ids]  # [T, D]
    t = len(ids)
    half = cfg.head_dim // 2
    freqs = cfg.rope_theta ** (-np.arange(half) / half)
    angle = np.arange(t)[:, None] * freqs[None]  # [T, K/2]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]

    def norm(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w

    def rotate(v):  # [T, X, K]
        a, b = v[..., :half], v[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    group = cfg.num_heads // cfg.num_kv_heads
    causal = np.tril(np.ones((t, t), bool))
    for n in range(cfg.num_layers):
        h = norm(x, p["attn_norm"][n])
        q = rotate(np.einsum("td,dhk->thk", h, p["wq"][n]))
        k = rotate(np.einsum("td,dgk->tgk", h, p["wk"][n]))
        v = np.einsum("td,dgk->tgk", h, p["wv"][n])
        out = np.zeros_like(q)
        for head in range(cfg.num_heads):
            scores = q[:, head] @ k[:, head // group].T / np.sqrt(cfg.head_dim)
            scores = np.where(causal, scores, -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (weights / weights.sum(-1, keepdims=True)) @ v[:, head // group]
        x = x + np.einsum("thk,hkd->td", out, p["wo"][n])
        h = norm(x, p["mlp_norm"][n])
        gate, up = h @ p["w_gate"][n], h @ p["w_up"][n]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p["w_down"][n]
    x = norm(x, np.asarray(params.final_norm, np.float64))
    head = np.asarray(params.embed, np.float64).T if params.lm_head is None else np.asarray(params.lm_head, np.float64)
    return x @ head


def test_forward_matches_float64_numpy_reference(tiny_llama):
    cfg, params = tiny_llama
    ids = TINY["s1_ids"]
    expected = numpy_llama_forward(cfg, params, ids)
    logits, _ = forward(params, None, jnp.asarray(ids)[None], jnp.arange(len(ids), dtype=jnp.int32)[None], cfg=cfg)
    assert_close(np.asarray(logits[0]), expected, LOGITS_VS_FLOAT64, "f32 forward vs float64 numpy")
