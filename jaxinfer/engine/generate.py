"""The reference generator: one sequence at a time over a dense cache. Simple on purpose.

It is the yardstick the paged engine is tested against, so it has no scheduling, no paging and no
batching across requests: prefill the whole prompt in one forward, then decode token by token with the
same `model.forward`. Every SamplingParams field means here what it means in the engine, through the
engine's own parts: each step's sampling arrays come from the one per-row packer (plan.pack_sampling over
a `Request`, the host state), the draw is `sampling.sample` (bias, min_tokens, penalties, min_p, the
grammar / allowed_token_ids / bad_words mask of the request's guide, log-probabilities), stopping is
`stopping.OutputProcessor`. Only the penalties' token counts are computed differently: on the host, from
the request's own ids, not through the pool. Fields that act on text (stop, bad_words,
structured_outputs) need `tokenizer`; without one they are refused with a FieldError naming the field.

Imports model/, config, validation and scheduling/'s host types (request, plan, guided, stopping).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import LOGPROBS_MODES, ModelConfig
from jaxinfer.model import forward as model
from jaxinfer.model import kv_pool, sampling
from jaxinfer.model.params import Params
from jaxinfer.scheduling import guided, plan, stopping
from jaxinfer.scheduling.request import Request, SamplingParams, derive_seed
from jaxinfer.validation import FieldError, check_token_ids

_CACHE_ROUND = 128  # dense cache lengths are rounded up to this, to bound the number of compiles
_BIAS_ROUND = 8  # bias widths likewise
TEXT_FIELDS = ("stop", "bad_words", "structured_outputs")  # SamplingParams fields that need a tokenizer here

LogprobEntry = tuple[float, dict[int, float]]  # a token's log-probability and the top ones, as RequestOutput's


@dataclasses.dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "error" (a guide with no allowed token, or whose matcher failed)
    text: str = ""  # with a tokenizer: the output's text, cut at a stop string as RequestOutput.text; else ""
    logprobs: list[LogprobEntry] | None = None  # with SamplingParams.logprobs: one entry per generated token
    prompt_logprobs: list[LogprobEntry | None] | None = None  # with prompt_logprobs: per prompt token, None for the first
    samples: "list[Generation] | None" = None  # with n > 1: all n samples in order (this one is sample 0)
    error: str | None = None  # why, when finish_reason is "error" (as RequestOutput.error)


@functools.partial(jax.jit, static_argnames=("cfg", "num_top", "mode"), donate_argnames=("cache",))
def _step(params, cache, tokens, positions, arrays, counts, *, cfg, num_top, mode):
    """The forward over tokens [1, T] at positions [1, T] (the prompt, or the last token), then the draw
    from the logits of its last token. Donates `cache`. Returns (token i32[1], sampling.Logprobs [1], cache)."""
    last = jnp.array([tokens.shape[1] - 1], jnp.int32)
    logits, cache = model.forward(params, cache, tokens, positions, cfg=cfg, logit_indices=last)  # [1, 1, V]
    token, logprobs = sampling.sample(logits[:, 0], arrays, lambda: counts, num_top=num_top, mode=mode)
    return token, logprobs, cache


@functools.partial(jax.jit, static_argnames=("cfg", "num_top"))
def _prompt_logprobs(params, tokens, *, cfg, num_top):
    """Raw log-probabilities of prompt tokens 1.. [1, T] from the logits before each (sampling.Logprobs [T - 1])."""
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    logits, _ = model.forward(params, None, tokens, positions, cfg=cfg)  # [1, T, V]
    return sampling.top_logprobs(logits[0, :-1], tokens[0, 1:], num_top)


def _host(logprobs: sampling.Logprobs) -> plan.Logprobs:
    return plan.Logprobs(np.asarray(logprobs.token), np.asarray(logprobs.top_ids), np.asarray(logprobs.top))


class _Reference:
    """What every prompt of one `generate` call shares: the model, the stop rules and the guides."""

    def __init__(self, params: Params, cfg: ModelConfig, *, eos_id: int | None, tokenizer, logprobs_mode: str):
        if logprobs_mode not in LOGPROBS_MODES:
            raise FieldError("logprobs_mode", f"must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.params, self.cfg, self.eos_id, self.tokenizer, self.mode = params, cfg, eos_id, tokenizer, logprobs_mode
        decode = None if tokenizer is None else functools.partial(tokenizer.decode, skip_special=True)
        self.output = stopping.OutputProcessor(decode, eos_id, cfg.max_context)
        # llguidance's tokenizer is built on the first grammar only; allowed_token_ids alone never reads `tokenizer`.
        self.guides = guided.Guides(tokenizer, cfg.vocab_size)

    def check(self, prompt_ids: list[int], sp: SamplingParams) -> None:
        """Raise (naming the field) what this generator cannot run: token ids outside the vocabulary,
        an embedding request, a text field without a tokenizer, a request over the context."""
        if not prompt_ids:
            raise ValueError("empty prompt: at least one token is needed")
        check_token_ids("prompt", prompt_ids, self.cfg.vocab_size)
        check_token_ids("stop_token_ids", sp.stop_token_ids, self.cfg.vocab_size)
        check_token_ids("logit_bias", [token for token, _ in sp.logit_bias], self.cfg.vocab_size)
        check_token_ids("allowed_token_ids", sp.allowed_token_ids or (), self.cfg.vocab_size)
        if sp.pooling is not None:
            raise FieldError("pooling", "an embedding runs on the paged engine (LLM.embed); the reference generator computes tokens only")
        for name in TEXT_FIELDS if self.tokenizer is None else ():
            if getattr(sp, name):
                raise FieldError(name, "acts on text: the reference generator needs generate(..., tokenizer=...) to honour it")
        if len(prompt_ids) + sp.max_tokens > self.cfg.max_context:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sp.max_tokens}) exceeds the context ({self.cfg.max_context})")

    def token_counts(self, request: Request) -> sampling.TokenCounts:
        """The penalties' counts of the row ([1, V]), from the request's ids on the host."""
        output = np.bincount(np.asarray(request.output_ids, np.int64), minlength=self.cfg.vocab_size)[None].astype(np.int32)
        in_prompt = np.zeros((1, self.cfg.vocab_size), bool)
        in_prompt[0, request.prompt_ids] = True
        return sampling.TokenCounts(output, in_prompt)

    def arrays(self, request: Request, bias_width: int) -> sampling.SamplingArrays:
        """The row's sampling arrays, packed by the engine's per-row packer, and its token mask (its guide's,
        less min_tokens' bans, as engine.token_masks fills it)."""
        packed = plan.pack_sampling([request], bias_width=bias_width)
        mask = np.full((1, guided.mask_words(self.cfg.vocab_size)), -1, np.int32)  # all ones: free
        guided.fill_mask(mask[0], request.guide, request.next_token_bans())
        return sampling.SamplingArrays(
            temperature=packed["temperature"], top_k=packed["top_k"], top_p=packed["top_p"], seed=packed["seeds"], step=packed["steps"],
            min_p=packed["min_p"], presence=packed["presence"], frequency=packed["frequency"], repetition=packed["repetition"],
            bias_ids=packed["bias_ids"], bias_values=packed["bias_values"], num_logprobs=packed["num_logprobs"], token_mask=mask,
        )

    def run(self, prompt_ids: list[int], sp: SamplingParams, seed: int, request_id: str) -> Generation:
        """One sample: prefill, then decode until the output processor stops it (max_tokens=0: only the prompt's scores)."""
        if sp.max_tokens == 0:
            return Generation([], "length", "", [] if sp.logprobs is not None else None, self.prompt_logprobs(prompt_ids, sp))
        cfg, total = self.cfg, len(prompt_ids) + sp.max_tokens
        request = Request(request_id, list(prompt_ids), sp, seed, eos_id=self.eos_id, **self.guides.request_fields(sp, prompt_ids))
        bias_width = max(-(-len(sp.logit_bias) // _BIAS_ROUND) * _BIAS_ROUND, _BIAS_ROUND)
        cache = kv_pool.init_dense_cache(cfg, 1, min(-(-total // _CACHE_ROUND) * _CACHE_ROUND, max(cfg.max_context, total)))
        num_top = max(sp.logprobs or 0, 1)
        tokens, start, reason = list(prompt_ids), 0, None
        while reason is None:
            positions = np.arange(start, start + len(tokens), dtype=np.int32)[None]
            token, logprobs, cache = _step(self.params, cache, np.asarray([tokens], np.int32), positions, self.arrays(request, bias_width),
                                           self.token_counts(request), cfg=cfg, num_top=num_top, mode=self.mode)
            request.output_ids.append(int(token[0]))
            if sp.logprobs is not None:
                request.logprobs.append(_host(logprobs).entry(0, sp.logprobs))
            reason = self.output.check(request)
            tokens, start = request.output_ids[-1:], request.num_tokens - 1
        text = self.output.text(request)
        logprobs = list(request.logprobs) if sp.logprobs is not None else None
        return Generation(list(request.output_ids), reason, text, logprobs, self.prompt_logprobs(prompt_ids, sp), error=request.error)

    def prompt_logprobs(self, prompt_ids: list[int], sp: SamplingParams) -> list[LogprobEntry | None] | None:
        if sp.prompt_logprobs is None:
            return None
        if len(prompt_ids) == 1:
            return [None]
        scored = _host(_prompt_logprobs(self.params, np.asarray([prompt_ids], np.int32), cfg=self.cfg, num_top=max(sp.prompt_logprobs, 1)))
        entries = [None] + [scored.entry(i, sp.prompt_logprobs) for i in range(len(prompt_ids) - 1)]
        return [None if i < sp.logprob_start else entry for i, entry in enumerate(entries)]  # None before logprob_start, as the engine's


def generate_one(
    params: Params, cfg: ModelConfig, prompt_ids: list[int], sp: SamplingParams, *, seed: int, eos_id: int | None,
    tokenizer=None, logprobs_mode: str = "raw",
) -> Generation:
    """Generate for one prompt: its n samples (sample i > 0 seeded from `seed` and i, as LLM.generate), each
    stopped as the engine stops it (EOS unless ignore_eos, a stop token or string, a finished grammar,
    max_tokens; 'error' when its constraints leave no token). Raises FieldError naming a field it cannot honour (module docstring)."""
    return _generate_one(_Reference(params, cfg, eos_id=eos_id, tokenizer=tokenizer, logprobs_mode=logprobs_mode), prompt_ids, sp, seed, 0)


def _generate_one(reference: _Reference, prompt_ids: list[int], sp: SamplingParams, seed: int, index: int) -> Generation:
    reference.check(prompt_ids, sp)
    seeds = [seed if sample == 0 else derive_seed(seed, f"sample:{sample}") for sample in range(sp.n)]
    samples = [reference.run(prompt_ids, sp, s, f"{index}:{sample}") for sample, s in enumerate(seeds)]
    return samples[0] if sp.n == 1 else dataclasses.replace(samples[0], samples=samples)


def generate(
    params: Params, cfg: ModelConfig, prompts: list[list[int]], sp: SamplingParams | list[SamplingParams], *, seed: int = 0,
    eos_id: int | None = None, tokenizer=None, logprobs_mode: str = "raw",
) -> list[Generation]:
    """Reference generation for each prompt in turn (token ids in, token ids out).

    Args:
      seed: the engine seed (EngineConfig.seed) that prompts without SamplingParams.seed derive theirs from,
        by their index, as LLM.generate does; so equal seeds give the engine's draws.
      eos_id: the end-of-sequence id (stops a request unless ignore_eos; masked by min_tokens).
      tokenizer: a loading.tokenizer.TextTokenizer, needed for stop strings, bad_words and
        structured_outputs, and for `Generation.text`.
      logprobs_mode: "raw" or "processed", as EngineConfig.logprobs_mode.
    """
    per_prompt = sp if isinstance(sp, list) else [sp] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
    reference = _Reference(params, cfg, eos_id=eos_id, tokenizer=tokenizer, logprobs_mode=logprobs_mode)
    seeds = [p.seed if p.seed is not None else derive_seed(seed, f"index:{i}") for i, p in enumerate(per_prompt)]  # as LLM.generate
    return [_generate_one(reference, ids, p, s, i) for i, (ids, p, s) in enumerate(zip(prompts, per_prompt, seeds))]
