"""The reference generator: one sequence at a time over a dense cache. Simple on purpose.

It is the yardstick the paged engine is tested against, so it has no scheduling, no paging and no
batching across requests: prefill the whole prompt in one forward, then decode token by token with the
same `model.forward` and the same sampler the engine uses.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import kv_pool, forward as model, sampling
from jaxinfer.config import ModelConfig
from jaxinfer.model.params import Params
from jaxinfer.scheduling.stopping import token_stop_reason
from jaxinfer.scheduling.request import SamplingParams, derive_seed

_CACHE_ROUND = 128  # dense cache lengths are rounded up to this, to bound the number of compiles


@dataclasses.dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _prefill(params, cache, tokens, sampling_arrays, *, cfg):
    """Prefill one prompt [1, T]; donates `cache`. Returns (first token, logits [1, V], cache)."""
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    last = jnp.array([tokens.shape[1] - 1], jnp.int32)
    logits, cache = model.forward(params, cache, tokens, positions, cfg=cfg, logit_indices=last)
    return sampling.next_tokens(logits[:, 0], sampling_arrays), cache


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _decode(params, cache, token, position, sampling_arrays, *, cfg):
    """One decode step for [1, 1]; donates `cache`."""
    logits, cache = model.forward(params, cache, token, position, cfg=cfg)
    return sampling.next_tokens(logits[:, 0], sampling_arrays), cache


def generate_one(params: Params, cfg: ModelConfig, prompt_ids: list[int], sp: SamplingParams, *, seed: int, eos_id: int | None) -> Generation:
    """Generate for one prompt; stops on EOS (unless ignore_eos), a stop token, or max_tokens."""
    if not prompt_ids:
        raise ValueError("empty prompt: at least one token is needed")
    total = len(prompt_ids) + sp.max_tokens
    if total > cfg.max_context:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sp.max_tokens}) exceeds the context ({cfg.max_context})")
    cache_len = min(-(-total // _CACHE_ROUND) * _CACHE_ROUND, max(cfg.max_context, total))
    cache = kv_pool.init_dense_cache(cfg, 1, cache_len)
    arrays = lambda step: sampling.pack([sp], np.array([seed]), np.array([step]))  # noqa: E731
    token, cache = _prefill(params, cache, jnp.array([prompt_ids], jnp.int32), arrays(0), cfg=cfg)
    out = [int(token[0])]
    while (reason := token_stop_reason(out, sp, eos_id)) is None:
        position = jnp.array([[len(prompt_ids) + len(out) - 1]], jnp.int32)
        token, cache = _decode(params, cache, token[:, None], position, arrays(len(out)), cfg=cfg)
        out.append(int(token[0]))
    return Generation(out, reason)


def generate(params: Params, cfg: ModelConfig, prompts: list[list[int]], sp: SamplingParams | list[SamplingParams], *, seed: int = 0, eos_id: int | None = None) -> list[Generation]:
    """Reference generation for each prompt in turn (token ids in, token ids out)."""
    per_prompt = sp if isinstance(sp, list) else [sp] * len(prompts)
    seeds = [p.seed if p.seed is not None else derive_seed(seed, f"index:{i}") for i, p in enumerate(per_prompt)]  # as LLM.generate
    return [generate_one(params, cfg, ids, p, seed=s, eos_id=eos_id) for ids, p, s in zip(prompts, per_prompt, seeds)]
