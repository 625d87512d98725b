"""Scoring continuations at eval speed: `LLM.score(context, continuations)` and `score_pairs`.

A continuation's score is the sum of its tokens' log-probabilities given the context (and the continuation's
earlier tokens), from the model's raw logits in float32. Each (context, continuation) pair runs as one
request of `context + continuation` with `prompt_logprobs=1`, `logprob_start=len(context)` and
`max_tokens=0`: it generates nothing, and only the positions from the context's last token on need logits.
Contexts shared by several continuations are prefilled once first (a `max_tokens=0` request that scores
nothing), so their full pages are in the prefix cache when the continuations run (kv_manager shares them:
Request.first_logits_position is the rule). Many pairs (an lm-eval task) run in batches whose contexts fit
half the pool, so a context is not evicted before its continuations run. Imports api's LLM only for its type; nothing imports this
module but api.py (lazily) and the lm-eval model.
"""

import dataclasses
from collections.abc import Sequence

from jaxinfer.scheduling.request import SamplingParams
from jaxinfer.validation import FieldError


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """One continuation's score given its context."""

    logprob: float  # sum of token_logprobs: log P(continuation | context)
    token_logprobs: list[float]  # per continuation token, natural log
    token_ids: list[int]  # the continuation's tokens, as scored
    is_greedy: bool  # every token was the most likely one at its position (lm-eval's second value)
    num_cached_tokens: int = 0  # context tokens whose KV came from the prefix cache


def encode_pair(llm, context, continuation) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids). Token ids are taken as given (checked against the vocabulary). Texts
    are split as lm-eval splits them: the context's trailing whitespace moves to the continuation, the whole text
    is tokenized, and the continuation is what follows the context's own tokens (so a word is tokenized as
    it is inside the whole text)."""
    if isinstance(context, str) and isinstance(continuation, str):
        stripped = context.rstrip()
        continuation, context = context[len(stripped):] + continuation, stripped
        if not context:
            raise FieldError("context", "is empty (nothing to condition on: give at least one token)")
        context_ids = llm.encode(context)
        whole = llm.encode(context + continuation)
        continuation_ids = whole[len(context_ids):]
    else:
        context_ids = llm.encode(context)
        continuation_ids = _continuation_ids(llm, continuation)
    if not continuation_ids:
        raise FieldError("continuation", f"{continuation!r} gives no tokens to score")
    return context_ids, continuation_ids


def _continuation_ids(llm, continuation) -> list[int]:
    """A continuation's ids on its own: text is tokenized without the BOS a prompt would get."""
    if isinstance(continuation, str):
        return llm.encode(llm.tokenizer.encode(continuation, add_bos=False, parse_special=llm.options.parse_special is not False)) if continuation else []
    return llm.encode(continuation)


def score(llm, context, continuations: Sequence, *, on_step=None, progress: bool | None = False) -> list[ScoreResult]:
    """Score each continuation given one context (text or token ids each); one ScoreResult per
    continuation, in order. The context is prefilled once and shared through the prefix cache."""
    if isinstance(continuations, (str, bytes)) or not isinstance(continuations, Sequence):
        raise FieldError("continuations", f"must be a list of texts or of token-id lists, got {type(continuations).__name__}")
    if not continuations:
        return []
    pairs = [encode_pair(llm, context, continuation) for continuation in continuations]
    return score_pairs(llm, pairs, on_step=on_step, progress=progress)


def score_pairs(llm, pairs: Sequence[tuple[list[int], list[int]]], *, on_step=None, progress: bool | None = False) -> list[ScoreResult]:
    """Score (context ids, continuation ids) pairs, in order. The pairs run in batches whose distinct contexts
    fit half the KV pool (`_batches`), so a context's pages stay cached until its pairs have run; in each
    batch, contexts of two pairs or more (at least a page long) are prefilled first, in a batch of their own."""
    _check_fit(llm, pairs)
    batches = _batches(llm, pairs)
    results: list[ScoreResult | None] = [None] * len(pairs)
    for batch in batches:
        chosen = [pairs[i] for i in batch]
        for i, result in zip(batch, _score_batch(llm, chosen, on_step=on_step, progress=progress if len(batches) == 1 else False)):
            results[i] = result
    return results


def _score_batch(llm, pairs, *, on_step, progress) -> list[ScoreResult]:
    shared = _shared_contexts(llm, pairs)
    if shared:
        warm = [SamplingParams(max_tokens=0, prompt_logprobs=0, logprob_start=len(ids)) for ids in shared]
        llm.generate(shared, warm, progress=progress, on_step=on_step)
    prompts = [context + continuation for context, continuation in pairs]
    params = [SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=1, logprob_start=len(context)) for context, _ in pairs]
    outputs = llm.generate(prompts, params, progress=progress, on_step=on_step)
    return [_result(output, len(context)) for output, (context, _) in zip(outputs, pairs)]


def _batches(llm, pairs) -> list[list[int]]:
    """Indices of the pairs in batches, the pairs of one context together (contexts in first-seen order),
    each batch's distinct contexts holding at most half the pool's pages (one context alone may hold more)."""
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i, (context, _) in enumerate(pairs):
        by_context.setdefault(tuple(context), []).append(i)
    page_size, budget = llm.engine_config.page_size, max(1, min(r.engine.num_pages for r in llm.replicas) // 2)
    batches, current, used = [], [], 0
    for context, indices in by_context.items():
        pages = -(-len(context) // page_size)
        if current and used + pages > budget:
            batches.append(current)
            current, used = [], 0
        current, used = current + indices, used + pages
    return batches + [current] if current else batches


def _check_fit(llm, pairs) -> None:
    limit = llm.engine_config.max_context
    for i, (context, continuation) in enumerate(pairs):
        if not context or not continuation:
            raise FieldError("context" if not context else "continuation", f"of pair {i} is empty")
        if len(context) + len(continuation) > limit:  # a prompt of exactly max_context tokens fits (it generates nothing)
            raise FieldError("context", f"of pair {i}: {len(context)} + {len(continuation)} tokens do not fit the context of {limit} (cut the context's start)")


def _shared_contexts(llm, pairs) -> list[list[int]]:
    """The distinct contexts worth prefilling first: used by two pairs or more and at least a page long,
    with the prefix cache on (off, nothing could be shared)."""
    if not llm.engine_config.enable_prefix_caching:
        return []
    counts: dict[tuple[int, ...], int] = {}
    for context, _ in pairs:
        counts[tuple(context)] = counts.get(tuple(context), 0) + 1
    return [list(ids) for ids, count in counts.items() if count > 1 and len(ids) > llm.engine_config.page_size]


def _result(output, start: int) -> ScoreResult:
    """A pair's ScoreResult from its request's output: prompt_logprobs entries from `start` on."""
    if output.finish_reason == "error" or output.prompt_logprobs is None:
        raise RuntimeError(f"scoring failed: {output.error or output.finish_reason}")
    ids = output.prompt_token_ids[start:]
    entries = output.prompt_logprobs[start:]
    token_logprobs = [entry[0] for entry in entries]
    greedy = all(max(top, key=top.get) == token for token, (_, top) in zip(ids, entries))
    return ScoreResult(sum(token_logprobs), token_logprobs, list(ids), greedy, output.num_cached_tokens)
