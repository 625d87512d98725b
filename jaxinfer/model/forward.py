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
`rope.rotary_frequencies`, `attention_bias` and `qk_norm` by `attention_inputs`. Nothing branches on the
architecture's name.

Every weight matmul goes through `_matmul` (`quant.qeinsum`) and the embedding lookup through
`quant.take`, so one forward serves dense and quantized params alike: on a dense array they are exactly
`jnp.einsum` and `w[tokens]`; a QuantizedTensor is dequantized inside the scanned layer body, so at most
one layer's weights are expanded at a time. The tied head multiplies by the embedding in whatever format
it is kept. The engine's step params for the CPU kernels hold panels instead (panels.py owns that
layout): `_matmul` hands them to `panels.einsum`, and the layers scan in place (`panels.scan_in_place`).
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxinfer.model import attention, panels, quant
from jaxinfer.model import kv_pool as kvp
from jaxinfer.config import ModelConfig
from jaxinfer.model.params import LayerParams, Params
from jaxinfer.model.rope import rope, rotary_frequencies  # noqa: F401  (called here; tests patch them by this module's name)


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
    (`qk_norm`, before rope, as Qwen3 does), then rope on q and k."""
    q = _matmul("btd,dhk->bthk", h, layer.wq)  # [B, T, H, K]
    k = _matmul("btd,dgk->btgk", h, layer.wk)  # [B, T, G, K]
    v = _matmul("btd,dgk->btgk", h, layer.wv)  # [B, T, G, K]
    if cfg.attention_bias:
        q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
    if cfg.qk_norm:
        q, k = rms_norm(q, layer.q_norm, cfg.rms_norm_eps), rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
    return rope(q, positions, inv_freq, cfg=cfg), rope(k, positions, inv_freq, cfg=cfg), v  # cfg: yarn / longrope attention factor


def mlp(x: Float[Array, "B T D"], layer: LayerParams) -> Float[Array, "B T D"]:
    gate = _matmul("btd,df->btf", x, layer.w_gate)
    up = _matmul("btd,df->btf", x, layer.w_up)
    return _matmul("btf,fd->btd", jax.nn.silu(gate) * up, layer.w_down)


def _layer(carry, layer_and_index, *, positions, inv_freq, pages, cfg: ModelConfig, impl: str):
    x, cache = carry  # x: [B, T, D]
    layer, index = layer_and_index
    with jax.named_scope("attention"):
        h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        q, k, v = attention_inputs(h, layer, positions, inv_freq, cfg)
        out, cache = attention.attend(cache, index, q, k, v, positions, pages, impl, window=cfg.sliding_window)
        x = x + _matmul("bthk,hkd->btd", out, layer.wo)
    with jax.named_scope("mlp"):
        x = x + mlp(rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps), layer)
    return (x, cache), None


def logits_from_hidden(params: Params, x: Float[Array, "B T D"], cfg: ModelConfig) -> Float[Array, "B T V"]:
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    # A tied head is the embedding in its kept format (params.weight_format owns that choice): quantized,
    # the head is dequantized once per step, [V, D] at a time, outside the layer scan.
    if params.lm_head is None:
        return _matmul("btd,vd->btv", x, params.embed, preferred_element_type=jnp.float32)
    return _matmul("btd,dv->btv", x, params.lm_head, preferred_element_type=jnp.float32)


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
    x = quant.take(params.embed, tokens, dtype=jnp.dtype(cfg.dtype))  # [B, T, D]
    inv_freq = rotary_frequencies(positions, cfg)  # [B or 1, R]
    body = functools.partial(_layer, positions=positions, inv_freq=inv_freq, pages=pages, cfg=cfg, impl=attention_impl)
    layer_index = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    if panels.is_packed(params.layers):  # the CPU kernels' step params: each layer's matmuls read the stacks in place
        (x, cache), _ = panels.scan_in_place(body, (x, cache), params.layers, layer_index)
    else:
        (x, cache), _ = jax.lax.scan(body, (x, cache), (params.layers, layer_index))
    return x, cache


def hidden_at(x: Float[Array, "B T D"], logit_indices: Int[Array, "B"] | Int[Array, "B J"]) -> Float[Array, "B J D"]:
    """The hidden states at token index logit_indices[b] (or [b, j]) of each row."""
    indices = logit_indices if logit_indices.ndim == 2 else logit_indices[:, None]  # [B, J]
    return jnp.take_along_axis(x, indices[:, :, None], axis=1)
