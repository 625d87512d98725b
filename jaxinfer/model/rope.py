"""Rotary position embeddings: the inverse frequencies a config's rope scaling gives, and their application.

The one owner of rope scaling (`ModelConfig.rope_theta`, `ModelConfig.rope_scaling`): forward.py calls
`rotary_frequencies` once per step and `rope` on q and k of every layer. Axis letters as in forward.py:
B batch, T tokens, X heads, K head dim, R rotary frequencies (K/2).
"""

import functools

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxinfer.config import ModelConfig, RopeScaling


def _llama3_divisors(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Llama 3 scaling as one divisor per frequency [R]: wavelengths longer than original context /
    low_freq_factor are stretched by `factor`, those shorter than original / high_freq_factor are kept,
    and the band between is blended linearly in 1/divisor."""
    wavelength = 2 * np.pi / inv_freq
    original = scaling.original_max_position
    smooth = (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    divisors = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    divisors = np.where(wavelength > original / scaling.low_freq_factor, scaling.factor, divisors)
    return np.where(wavelength < original / scaling.high_freq_factor, 1.0, divisors)


@functools.lru_cache(maxsize=64)
def _scaled_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse rotary frequencies [R] (a host constant) after linear, llama3 or per-frequency scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [R]
    divisors = {
        "linear": lambda: np.full_like(inv_freq, scaling.factor),
        "llama3": lambda: _llama3_divisors(inv_freq, scaling),
        "frequency_factors": lambda: np.asarray(scaling.frequency_factors, np.float64),
    }
    if scaling is not None and scaling.kind in divisors:
        inv_freq = inv_freq / divisors[scaling.kind]()
    return inv_freq.astype(np.float32)


def rotary_frequencies(positions: Int[Array, "B T"], cfg: ModelConfig) -> Float[Array, "#B R"]:
    """Inverse frequencies of the rotary pairs for these rows, as `cfg.rope_scaling` says.

    Dynamic (NTK) scaling grows the base with the row's length, max(position) + 1, once it passes the
    original context, as transformers does per forward call; keys already cached keep the base they had.
    """
    inv_freq = jnp.asarray(_scaled_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))[None]  # [1, R]
    scaling = cfg.rope_scaling
    if scaling is None or scaling.kind != "dynamic":
        return inv_freq
    original, factor, dim = scaling.original_max_position, scaling.factor, cfg.head_dim
    length = jnp.maximum(positions.max(axis=1) + 1, original).astype(jnp.float32)  # [B]
    growth = (factor * length / original - (factor - 1)) ** (dim / (dim - 2))  # [B], base multiplier
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim  # [R]
    return inv_freq * growth[:, None] ** -exponents[None]  # [B, R]


def rope(x: Float[Array, "B T X K"], positions: Int[Array, "B T"], inv_freq: Float[Array, "#B R"]) -> Float[Array, "B T X K"]:
    """Rotary embedding in the rotate-half layout: pairs are (i, i + K/2). Angles in f32."""
    half = x.shape[-1] // 2
    angles = positions.astype(jnp.float32)[..., None] * inv_freq[:, None, :]  # [B, T, R]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]  # [B, T, 1, R]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
