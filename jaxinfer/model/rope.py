"""Rotary position embeddings: the inverse frequencies a config's rope scaling gives, and their application.

The one owner of rope scaling (`ModelConfig.rope_theta`, `rope_scaling`, `rotary_dim`): forward.py calls
`rotary_frequencies` once per step and `rope` on q and k of every layer. Axis letters as in forward.py:
B batch, T tokens, X heads, K head dim, R rotary frequencies (rotary dims / 2, K/2 unless `rotary_dim`).

Every scaling is a set of frequencies and a constant: linear, llama3, yarn and per-frequency divisors are
host constants; dynamic (NTK) and longrope depend on the row's length, max(position) + 1, as transformers
decides per forward call. yarn and longrope multiply cos and sin by their attention factor, which `rope`
applies when given the config.
"""

import functools
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxinfer.config import ModelConfig, RopeScaling


def rotary_dims(cfg: ModelConfig) -> int:
    """Leading dims of each head that rope turns (the rest pass through, Phi-4-mini's partial rotary)."""
    return cfg.rotary_dim or cfg.head_dim


def attention_factor(cfg: ModelConfig | None) -> float:
    """What cos and sin are multiplied by: yarn's and longrope's attention factor, else 1."""
    scaling = None if cfg is None else cfg.rope_scaling
    return 1.0 if scaling is None else scaling.attention_factor


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


def _yarn_frequencies(inv_freq: np.ndarray, dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN [R], as transformers' `_compute_yarn_parameters`: frequency i is inv_freq / factor (interpolated)
    below dimension `low`, inv_freq (extrapolated) above `high`, blended linearly between. low and high are
    where a frequency turns beta_fast and beta_slow times over the original context (rounded outward with
    `truncate`, clipped to [0, dim - 1])."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    extrapolated = 1 - np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)  # [R], 1: keep inv_freq
    return inv_freq / scaling.factor * (1 - extrapolated) + inv_freq * extrapolated


@functools.lru_cache(maxsize=64)
def _scaled_frequencies(dim: int, theta: float, scaling: RopeScaling | None, long: bool = False) -> np.ndarray:
    """Inverse rotary frequencies [R] (a host constant) of `dim` rotary dims after linear, llama3, yarn,
    per-frequency or longrope scaling (`long`: longrope's factors for rows past the original context)."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)  # [R]
    divisors = {
        "linear": lambda: np.full_like(inv_freq, scaling.factor),
        "llama3": lambda: _llama3_divisors(inv_freq, scaling),
        "frequency_factors": lambda: np.asarray(scaling.frequency_factors, np.float64),
        "longrope": lambda: np.asarray(scaling.long_factors if long else scaling.short_factors, np.float64),
    }
    if scaling is not None and scaling.kind == "yarn":
        inv_freq = _yarn_frequencies(inv_freq, dim, theta, scaling)
    elif scaling is not None and scaling.kind in divisors:
        inv_freq = inv_freq / divisors[scaling.kind]()
    return inv_freq.astype(np.float32)


def rotary_frequencies(positions: Int[Array, "B T"], cfg: ModelConfig) -> Float[Array, "#B R"]:
    """Inverse frequencies of the rotary pairs for these rows, as `cfg.rope_scaling` says.

    Dynamic (NTK) scaling grows the base with the row's length, max(position) + 1, once it passes the
    original context, as transformers does per forward call; keys already cached keep the base they had.
    LongRoPE takes its long factors for a row whose length passes the original context, its short ones
    otherwise (transformers' rule, made per row).
    """
    dim, scaling = rotary_dims(cfg), cfg.rope_scaling
    inv_freq = jnp.asarray(_scaled_frequencies(dim, cfg.rope_theta, scaling))[None]  # [1, R]
    if scaling is None or scaling.kind not in ("dynamic", "longrope"):
        return inv_freq
    length = positions.max(axis=1) + 1  # [B]
    if scaling.kind == "longrope":
        long_freq = jnp.asarray(_scaled_frequencies(dim, cfg.rope_theta, scaling, long=True))[None]  # [1, R]
        return jnp.where((length > scaling.original_max_position)[:, None], long_freq, inv_freq)  # [B, R]
    original, factor = scaling.original_max_position, scaling.factor
    length = jnp.maximum(length, original).astype(jnp.float32)  # [B]
    growth = (factor * length / original - (factor - 1)) ** (dim / (dim - 2))  # [B], base multiplier
    exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim  # [R]
    return inv_freq * growth[:, None] ** -exponents[None]  # [B, R]


def rope(
    x: Float[Array, "B T X K"], positions: Int[Array, "B T"], inv_freq: Float[Array, "#B R"], *, cfg: ModelConfig | None = None,
) -> Float[Array, "B T X K"]:
    """Rotary embedding in the rotate-half layout over the first 2R dims of each head: pairs are (i, i + R),
    the dims past 2R pass through unchanged. Angles in f32. With `cfg`, cos and sin are multiplied by its
    rope scaling's attention factor (yarn, longrope), as transformers does."""
    half = inv_freq.shape[-1]  # R
    scale = attention_factor(cfg)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq[:, None, :]  # [B, T, R]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]  # [B, T, 1, R]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half : 2 * half].astype(jnp.float32)
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * half < x.shape[-1]:
        rotated.append(x[..., 2 * half :].astype(jnp.float32))
    return jnp.concatenate(rotated, axis=-1).astype(x.dtype)
