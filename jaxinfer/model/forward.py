"""The Llama-family decoder as pure functions over a params pytree.

Axis letters used in every einsum, shape comment and jaxtyping annotation (here and in attention.py):
    B batch · T query tokens · S key/value tokens · D embed · H query heads · G kv heads
    Q query heads per kv head · K head dim · F ffn · V vocab · N layers · L page length
    P pages (of the pool, or of one block table) · X heads of either kind, H or G (rope takes both)
    R rotary frequencies (K/2) · J logit positions per row (the sequences of a packed prefill row)
A leading `#` (jaxtyping) means "that size or 1": `forward` returns [B, 1, V] with `logit_indices`.

One `forward` serves the no-cache reference (cache=None), the dense cache of the reference generator
and the paged pool of the engine: only the cache argument differs. Layers are stacked and run with
`lax.scan`, so compile time does not grow with depth. The cache rides in the scan carry and each layer
updates its own slice, which XLA does in place when the caller donates the cache.

Family features are ModelConfig fields, each read by one function: `rope_scaling` by
`rope.rotary_frequencies`, `attention_bias`, `qk_norm`, `v_norm` and `query_scale` by `attention_inputs`,
`hidden_act` by `mlp`, `post_norms` and `layer_scale` by `_layer`, `embed_scale` by `hidden_states`,
`final_logit_softcap` by `logits_from_hidden`, `attn_logit_softcap` by `attention.attend`, and `layer_types` / `local_rope_theta` / `sliding_window` by
`_layer_rope` and `_layer_windows` (each layer picks its rope and window by its index inside the scan).
Nothing branches on the architecture's name.

Every weight matmul goes through `_matmul` (`quant.qeinsum`) and the embedding lookup through
`embed_lookup` (`quant.take`, or K-quant panels' rows), so one forward serves dense and quantized params alike: on a dense array they are exactly
`jnp.einsum` and `w[tokens]`; a QuantizedTensor is dequantized inside the scanned layer body, so at most
one layer's weights are expanded at a time. The tied head multiplies by the embedding in whatever format
it is kept. The engine's step params for the CPU kernels hold panels instead (panels.py owns that
layout): `_matmul` hands them to `panels.einsum`, and the layers scan in place (`panels.scan_in_place`).
"""

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxinfer.model import attention, panels, quant
from jaxinfer.model import kv_pool as kvp
from jaxinfer.config import ModelConfig
from jaxinfer.model.panel_tensors import KQuantPanelTensor, QuantPanelTensor, head_view, kquant_take, quant_take
from jaxinfer.model.params import LayerParams, Params
from jaxinfer.model.rope import rope, rotary_frequencies  # noqa: F401  (called here; tests patch them by this module's name)

_ATTEND_TAKES_WINDOW = "window" in inspect.signature(attention.attend).parameters


def _matmul(spec: str, x: Float[Array, "..."], w, *, preferred_element_type=None) -> Float[Array, "..."]:
    """One weight matmul, `einsum(spec, x, w)`: panels through the CPU kernel, anything else (dense or
    quantized) through quant.qeinsum."""
    einsum = panels.einsum if panels.is_panel(w) else quant.qeinsum
    return einsum(spec, x, w, preferred_element_type=preferred_element_type)


def rms_norm(x: Float[Array, "... D"], weight: Float[Array, "D"], eps: float) -> Float[Array, "... D"]:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def attention_inputs(
    h: Float[Array, "B T D"], layer: LayerParams, positions: Int[Array, "B T"], inv_freq: Float[Array, "#B R"], cfg: ModelConfig
) -> tuple[Float[Array, "B T H K"], Float[Array, "B T G K"], Float[Array, "B T G K"]]:
    """q, k, v of one layer: projections, + biases (`attention_bias`), per-head RMSNorm of q and k
    (`qk_norm`, before rope, as Qwen3 and Gemma do) and a weightless one of v (`v_norm`, Gemma 4), then rope
    on q and k. With `query_scale`, q is pre-scaled so that attention's head_dim ** -0.5 makes it that scale."""
    q = _matmul("btd,dhk->bthk", h, layer.wq)  # [B, T, H, K]
    k = _matmul("btd,dgk->btgk", h, layer.wk)  # [B, T, G, K]
    v = _matmul("btd,dgk->btgk", h, layer.wv)  # [B, T, G, K]
    if cfg.attention_bias:
        q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
    if cfg.qk_norm:
        q, k = rms_norm(q, layer.q_norm, cfg.rms_norm_eps), rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
    if cfg.v_norm:
        v = rms_norm(v, jnp.ones((), jnp.float32), cfg.rms_norm_eps)
    q, k = rope(q, positions, inv_freq, cfg=cfg), rope(k, positions, inv_freq, cfg=cfg)  # cfg: yarn / longrope attention factor
    if cfg.query_scale is not None:
        q = (q.astype(jnp.float32) * (cfg.query_scale * cfg.head_dim**0.5)).astype(q.dtype)
    return q, k, v


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def mlp(x: Float[Array, "B T D"], layer: LayerParams, hidden_act: str = "silu") -> Float[Array, "B T D"]:
    """The gated MLP: act(x W_gate) * (x W_up), then W_down; SwiGLU (silu) or Gemma's GeGLU (tanh GELU)."""
    gate = _matmul("btd,df->btf", x, layer.w_gate)
    up = _matmul("btd,df->btf", x, layer.w_up)
    return _matmul("btf,fd->btd", _ACTIVATIONS[hidden_act](gate) * up, layer.w_down)


def _post_norm(y: Float[Array, "B T D"], weight, cfg: ModelConfig) -> Float[Array, "B T D"]:
    """A block's output before its residual add: RMS-normed with `post_norms` (Gemma), else as it is."""
    return rms_norm(y, weight, cfg.rms_norm_eps) if cfg.post_norms else y


def _layer(carry, layer_and_index, *, positions, inv_freq, pages, cfg: ModelConfig, impl: str):
    x, cache = carry  # x: [B, T, D]
    layer, index = layer_and_index
    with jax.named_scope("attention"):
        h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        q, k, v = attention_inputs(h, layer, positions, _layer_rope(inv_freq, index, cfg), cfg)
        window = _layer_windows(cfg)
        extra = {} if window is None or not _ATTEND_TAKES_WINDOW else {"window": window[index]}
        extra.update({} if cfg.attn_logit_softcap is None else {"softcap": cfg.attn_logit_softcap})  # a static float
        out, cache = attention.attend(cache, index, q, k, v, positions, pages, impl, **extra)
        x = x + _post_norm(_matmul("bthk,hkd->btd", out, layer.wo), layer.post_attn_norm, cfg)
    with jax.named_scope("mlp"):
        x = x + _post_norm(mlp(rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps), layer, cfg.hidden_act), layer.post_mlp_norm, cfg)
    if cfg.layer_scale:
        x = (x.astype(jnp.float32) * layer.layer_scale.astype(jnp.float32)).astype(x.dtype)
    return (x, cache), None


def _sliding_layers(cfg: ModelConfig) -> np.ndarray:
    """bool[N]: which layers are sliding-window layers (every one when layer_types is None and there is a window)."""
    if cfg.layer_types is None:
        return np.full(cfg.num_layers, cfg.sliding_window is not None)
    return np.asarray([t == "sliding_attention" for t in cfg.layer_types])


def _layer_windows(cfg: ModelConfig) -> jax.Array | None:
    """int32[N]: each layer's window for attention.attend, or None when no layer has one. A full layer
    gets max_context, a window no position reaches past (positions stay below max_context)."""
    if cfg.sliding_window is None:
        return None
    full = max(cfg.max_context, cfg.sliding_window)
    return jnp.asarray(np.where(_sliding_layers(cfg), cfg.sliding_window, full), jnp.int32)


def rotary_frequencies_per_type(positions: Int[Array, "B T"], cfg: ModelConfig) -> Float[Array, "#B R"] | Float[Array, "2 #B R"]:
    """The inverse rotary frequencies: one set for every layer, or with `local_rope_theta` two, stacked
    [full layers' (rope_theta, rope_scaling), sliding layers' (local_rope_theta, no scaling)]."""
    inv_freq = rotary_frequencies(positions, cfg)  # [B or 1, R]
    if cfg.local_rope_theta is None:
        return inv_freq
    local = rotary_frequencies(positions, dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None))
    return jnp.stack(jnp.broadcast_arrays(inv_freq, local))  # [2, B or 1, R]


def _layer_rope(inv_freq, index: Int[Array, ""], cfg: ModelConfig) -> Float[Array, "#B R"]:
    """This layer's inverse frequencies: the sliding layers' set on a sliding layer, when the config has two."""
    if cfg.local_rope_theta is None:
        return inv_freq
    return inv_freq[jnp.asarray(_sliding_layers(cfg), jnp.int32)[index]]


def logits_from_hidden(params: Params, x: Float[Array, "B T D"], cfg: ModelConfig) -> Float[Array, "B T V"]:
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    # A tied head is the embedding in its kept format (params.weight_format owns that choice): quantized,
    # the head is dequantized once per step, [V, D] at a time, outside the layer scan.
    if params.lm_head is None and isinstance(params.embed, (KQuantPanelTensor, QuantPanelTensor)):  # one copy: the embedding's panels are the head's
        logits = _matmul("btd,dv->btv", x, head_view(params.embed), preferred_element_type=jnp.float32)
    elif params.lm_head is None:
        logits = _matmul("btd,vd->btv", x, params.embed, preferred_element_type=jnp.float32)
    else:
        logits = _matmul("btd,dv->btv", x, params.lm_head, preferred_element_type=jnp.float32)
    if cfg.final_logit_softcap is not None:  # Gemma: cap * tanh(logits / cap)
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits


def forward(
    params: Params,
    cache: kvp.DenseKVCache | kvp.KVPool | None,
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    *,
    cfg: ModelConfig,
    pages: kvp.PageMeta | None = None,
    logit_indices: Int[Array, "B"] | Int[Array, "B J"] | None = None,
    attention_impl: str = "reference",
) -> tuple[Float[Array, "B #T V"] | Float[Array, "B J V"], kvp.DenseKVCache | kvp.KVPool | None]:
    """Run the decoder on `tokens` at `positions`, writing their K/V into `cache`.

    Args:
      cache: None (attend within `tokens` only), a DenseKVCache, or a paged KVPool (then `pages` is required).
      logit_indices: if given, logits are computed only at token index logit_indices[b] of each row,
        and the result is [B, 1, V]; this skips the vocabulary projection for the rest of a prefill chunk.
        Given as [B, J], J token indices per row (a packed row's sequences): the result is [B, J, V].
    Returns:
      (logits in f32, [B, T, V], or [B, 1, V] with `logit_indices`; the updated cache). Callers that
      donate the cache rebind it at once.
    """
    x, cache = hidden_states(params, cache, tokens, positions, cfg=cfg, pages=pages, attention_impl=attention_impl)
    if logit_indices is not None:
        x = hidden_at(x, logit_indices)
    return logits_from_hidden(params, x, cfg), cache


def hidden_states(
    params: Params, cache, tokens: Int[Array, "B T"], positions: Int[Array, "B T"], *, cfg: ModelConfig,
    pages: kvp.PageMeta | None = None, attention_impl: str = "reference",
) -> tuple[Float[Array, "B T D"], kvp.DenseKVCache | kvp.KVPool | None]:
    """The decoder's last hidden states (before the final norm) and the updated cache; see `forward`."""
    x = embed_lookup(params.embed, tokens, jnp.dtype(cfg.dtype))  # [B, T, D]
    if cfg.embed_scale != 1.0:  # Gemma: times sqrt(D), the factor cast to the compute dtype first (as transformers does)
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    inv_freq = rotary_frequencies_per_type(positions, cfg)  # [B or 1, R], or [2, B or 1, R] with local_rope_theta
    body = functools.partial(_layer, positions=positions, inv_freq=inv_freq, pages=pages, cfg=cfg, impl=attention_impl)
    layer_index = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    if panels.is_packed(params.layers):  # the CPU kernels' step params: each layer's matmuls read the stacks in place
        (x, cache), _ = panels.scan_in_place(body, (x, cache), params.layers, layer_index)
    else:
        (x, cache), _ = jax.lax.scan(body, (x, cache), (params.layers, layer_index))
    return x, cache


def embed_lookup(embed, tokens: Int[Array, "B T"], dtype) -> Float[Array, "B T D"]:
    """The embedding rows of `tokens`: a tied embedding kept as K-quant or quantized (Q8_0 / Q4_0 / Q4_1) panels (the
    head's, loading/kept_blocks.py) gathers the tokens' columns and dequantizes only those; dense or quantized tables
    go through quant.take."""
    if isinstance(embed, KQuantPanelTensor):
        return kquant_take(embed, tokens, dtype)
    if isinstance(embed, QuantPanelTensor):
        return quant_take(embed, tokens, dtype)
    return quant.take(embed, tokens, dtype=dtype)


def hidden_at(x: Float[Array, "B T D"], logit_indices: Int[Array, "B"] | Int[Array, "B J"]) -> Float[Array, "B J D"]:
    """The hidden states at token index logit_indices[b] (or [b, j]) of each row."""
    indices = logit_indices if logit_indices.ndim == 2 else logit_indices[:, None]  # [B, J]
    return jnp.take_along_axis(x, indices[:, :, None], axis=1)
