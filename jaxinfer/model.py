"""The Llama-family decoder as pure functions over a params pytree.

Axis letters used in every einsum, shape comment and jaxtyping annotation (here and in attention.py):
    B batch · T query tokens · S key/value tokens · D embed · H query heads · G kv heads
    Q query heads per kv head · K head dim · F ffn · V vocab · N layers · L page length
    P pages (of the pool, or of one block table) · X heads of either kind, H or G (rope takes both)
A leading `#` (jaxtyping) means "that size or 1": `forward` returns [B, 1, V] with `logit_indices`.

One `forward` serves the no-cache reference (cache=None), the dense cache of the reference generator
and the paged pool of the engine: only the cache argument differs. Layers are stacked and run with
`lax.scan`, so compile time does not grow with depth. The cache rides in the scan carry and each layer
updates its own slice, which XLA does in place when the caller donates the cache.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxinfer import attention
from jaxinfer import kv_pool as kvp
from jaxinfer.config import ModelConfig
from jaxinfer.params import LayerParams, Params


def rms_norm(x: Float[Array, "... D"], weight: Float[Array, "D"], eps: float) -> Float[Array, "... D"]:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x: Float[Array, "B T X K"], positions: Int[Array, "B T"], theta: float) -> Float[Array, "B T X K"]:
    """Rotary embedding in the rotate-half layout: pairs are (i, i + K/2). Angles in f32."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))  # [K/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, K/2]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]  # [B, T, 1, K/2]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def mlp(x: Float[Array, "B T D"], layer: LayerParams) -> Float[Array, "B T D"]:
    gate = jnp.einsum("btd,df->btf", x, layer.w_gate)
    up = jnp.einsum("btd,df->btf", x, layer.w_up)
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, layer.w_down)


def _layer(carry, layer_and_index, *, positions, pages, cfg: ModelConfig, impl: str):
    x, cache = carry  # x: [B, T, D]
    layer, index = layer_and_index
    with jax.named_scope("attention"):
        h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        q = rope(jnp.einsum("btd,dhk->bthk", h, layer.wq), positions, cfg.rope_theta)  # [B, T, H, K]
        k = rope(jnp.einsum("btd,dgk->btgk", h, layer.wk), positions, cfg.rope_theta)  # [B, T, G, K]
        v = jnp.einsum("btd,dgk->btgk", h, layer.wv)  # [B, T, G, K]
        out, cache = attention.attend(cache, index, q, k, v, positions, pages, impl)
        x = x + jnp.einsum("bthk,hkd->btd", out, layer.wo)
    with jax.named_scope("mlp"):
        x = x + mlp(rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps), layer)
    return (x, cache), None


def logits_from_hidden(params: Params, x: Float[Array, "B T D"], cfg: ModelConfig) -> Float[Array, "B T V"]:
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:
        return jnp.einsum("btd,vd->btv", x, params.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", x, params.lm_head, preferred_element_type=jnp.float32)


def forward(
    params: Params,
    cache: kvp.DenseKVCache | kvp.KVPool | None,
    tokens: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    *,
    cfg: ModelConfig,
    pages: kvp.PageMeta | None = None,
    logit_indices: Int[Array, "B"] | None = None,
    attention_impl: str = "reference",
) -> tuple[Float[Array, "B #T V"], kvp.DenseKVCache | kvp.KVPool | None]:
    """Run the decoder on `tokens` at `positions`, writing their K/V into `cache`.

    Args:
      cache: None (attend within `tokens` only), a DenseKVCache, or a paged KVPool (then `pages` is required).
      logit_indices: if given, logits are computed only at token index logit_indices[b] of each row,
        and the result is [B, 1, V]; this skips the vocabulary projection for the rest of a prefill chunk.
    Returns:
      (logits in f32, [B, T, V], or [B, 1, V] with `logit_indices`; the updated cache). Callers that
      donate the cache rebind it at once.
    """
    x = params.embed[tokens]  # [B, T, D]
    body = functools.partial(_layer, positions=positions, pages=pages, cfg=cfg, impl=attention_impl)
    layer_index = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, cache), _ = jax.lax.scan(body, (x, cache), (params.layers, layer_index))
    if logit_indices is not None:
        x = jnp.take_along_axis(x, logit_indices[:, None, None], axis=1)  # [B, 1, D]
    return logits_from_hidden(params, x, cfg), cache
