"""LLM.score and prompt logprobs from logprob_start: values against HF transformers (the fixtures' f32
log-softmax of a held-out 601-token passage), one context prefill for many continuations (counted from the
steps' positions), the prefix cache serving scoring requests, and the text split of lm-eval."""

import numpy as np
import pytest

from conftest import FIXTURES
from jaxinfer.scheduling.request import Prompt, SamplingParams
from jaxinfer.scoring import encode_pair
from jaxinfer.validation import FieldError

HF = np.load(FIXTURES / "smollm2_reference.npz")
PASSAGE = HF["p5_ids"].tolist()  # 601 tokens of held-out prose; HF's top-20 logits and logsumexp at each position
PAGE = 16  # SMOLLM2_SMALL_ENGINE's page size


def hf_logprob(position: int, token: int) -> float | None:
    """HF's f32 log-softmax of `token` after PASSAGE[: position + 1], where it is among the top 20 there."""
    top = HF["p5_top20_indices"][position].tolist()
    return float(HF["p5_top20_values"][position][top.index(token)] - HF["p5_logsumexp"][position]) if token in top else None


def covered_context_end(start: int, length: int) -> int:
    """The first context end >= start after which `length` passage tokens all have an HF log-probability."""
    end = start
    while any(hf_logprob(p - 1, PASSAGE[p]) is None for p in range(end, end + length)):
        end += 1
    return end


def test_score_matches_hf_log_softmax_within_1e4_on_held_out_text(smollm2_llm):
    end = covered_context_end(150, 8)
    context = PASSAGE[:end]
    true_prefixes = [PASSAGE[end : end + m] for m in (1, 3, 5, 8)]
    alternatives = [[int(HF["p5_top20_indices"][end - 1][rank])] for rank in (0, 1, 5, 19)]  # other next tokens, HF's ranks
    results = smollm2_llm.score(context, true_prefixes + alternatives)
    assert len(results) == 8
    for continuation, result in zip(true_prefixes + alternatives, results):
        expected = [hf_logprob(end - 1 + j, token) for j, token in enumerate(continuation)]
        assert result.token_ids == continuation
        np.testing.assert_allclose(result.token_logprobs, expected, atol=1e-4, rtol=0)
        assert abs(result.logprob - sum(expected)) < 1e-4 * len(continuation)
    assert results[4].is_greedy and not results[5].is_greedy  # HF's rank 0 is the argmax, rank 1 is not


def test_eight_continuations_prefill_their_500_token_context_once(tiny_scoring_llm):
    """Every position of the context's full pages is computed once (the first prefill), and each
    continuation computes only its tail page of the context and its own tokens."""
    llm = tiny_scoring_llm
    context = PASSAGE[:500]
    continuations = [PASSAGE[500 + 3 * i : 500 + 3 * i + 2 + i] for i in range(8)]
    computed: dict[int, int] = {}  # position -> times a step computed it
    steps = []

    def count(plan, tokens, seconds):
        steps.append(plan.num_real_tokens)
        for row, (start, length) in enumerate(zip(plan.chunk_starts(), plan.num_new_tokens)):
            for position in plan.positions[start[0], start[1] : start[1] + length]:
                computed[int(position)] = computed.get(int(position), 0) + 1

    llm.reset_prefix_cache()
    results = llm.score(context, continuations, on_step=count)
    shared_end = (len(context) - 1) // PAGE * PAGE  # the full pages before the context's last token
    assert all(computed[p] == 1 for p in range(shared_end)), "a context page was computed twice"
    assert all(computed[p] == 9 for p in range(shared_end, len(context)))  # the context's tail: once, then once per continuation
    assert sum(steps) == len(context) + sum(len(context) - shared_end + len(c) for c in continuations)
    assert [r.num_cached_tokens for r in results] == [shared_end] * 8


def test_score_equals_prompt_logprobs_without_the_prefix_cache(tiny_scoring_llm, tiny_uncached_llm):
    context, continuations = PASSAGE[:200], [PASSAGE[200:204], PASSAGE[300:303]]
    tiny_scoring_llm.reset_prefix_cache()
    scored = tiny_scoring_llm.score(context, continuations)
    for continuation, result in zip(continuations, scored):
        out = tiny_uncached_llm.generate([context + continuation], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
        assert out.num_cached_tokens == 0
        expected = [lp for lp, _ in out.prompt_logprobs[len(context) :]]
        np.testing.assert_allclose(result.token_logprobs, expected, atol=1e-5, rtol=0)


def test_prompt_logprobs_from_logprob_start_reuse_cached_pages_and_leave_earlier_entries_none(tiny_scoring_llm):
    llm = tiny_scoring_llm
    ids = PASSAGE[:100]
    llm.reset_prefix_cache()
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    whole = llm.generate([ids], SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2))[0]
    tail = llm.generate([ids], SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2, logprob_start=70))[0]
    assert whole.num_cached_tokens == 0 and tail.num_cached_tokens == 64  # pages before position 69
    assert tail.token_ids == [] and tail.finish_reason == "length" and tail.text == ""
    assert tail.prompt_logprobs[:70] == [None] * 70
    for mine, full in zip(tail.prompt_logprobs[70:], whole.prompt_logprobs[70:]):
        assert abs(mine[0] - full[0]) < 1e-5 and list(mine[1]) == list(full[1])


def test_max_tokens_zero_and_logprob_start_are_checked_where_built(tiny_scoring_llm):
    with pytest.raises(FieldError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(FieldError, match="logprob_start .* applies to prompt_logprobs"):
        SamplingParams(logprob_start=3)
    with pytest.raises(FieldError, match="logprob_start"):
        SamplingParams(prompt_logprobs=0, logprob_start=-1)
    with pytest.raises(FieldError, match=r"logprob_start \(9\) is past the prompt's 3 tokens"):
        Prompt(0, [1, 2, 3], SamplingParams(max_tokens=0, prompt_logprobs=0, logprob_start=9))
    with pytest.raises(FieldError, match="continuation"):
        tiny_scoring_llm.score("The cat", [""])
    with pytest.raises(FieldError, match="continuations"):
        tiny_scoring_llm.score("The cat", "sat")


def test_text_pairs_split_as_lm_eval_does(tiny_scoring_llm):
    """The context's trailing space moves to the continuation; the continuation is the whole text's tokens
    after the context's, so ' sat' scores as the token the whole sentence holds."""
    llm = tiny_scoring_llm
    context_ids, continuation_ids = encode_pair(llm, "The cat ", "sat on the mat")
    assert context_ids == llm.encode("The cat")
    assert context_ids + continuation_ids == llm.encode("The cat sat on the mat")
    by_text = llm.score("The cat ", ["sat on the mat"])[0]
    by_ids = llm.score(context_ids, [continuation_ids])[0]
    assert by_text.token_ids == continuation_ids and by_text.logprob == by_ids.logprob


@pytest.fixture(scope="module")
def tiny_scoring_llm(tiny_chat_model, compile_cache):
    from jaxinfer.api import LLM

    return LLM(str(tiny_chat_model), compilation_cache_dir=compile_cache, dtype="float32", **TINY_SCORING_ENGINE)


@pytest.fixture(scope="module")
def tiny_uncached_llm(tiny_chat_model, compile_cache):
    from jaxinfer.api import LLM

    return LLM(str(tiny_chat_model), compilation_cache_dir=compile_cache, dtype="float32", enable_prefix_caching=False, **TINY_SCORING_ENGINE)


TINY_SCORING_ENGINE = dict(
    max_context=512, page_size=PAGE, max_num_seqs=8, max_prefill_tokens=128, prefill_chunk_buckets=(32, 128),
    decode_batch_buckets=(8,), decode_page_buckets=(32,),
)


def test_the_dense_reference_scores_from_logprob_start_like_the_engine(tiny_scoring_llm):
    from jaxinfer.engine import generate

    llm, ids = tiny_scoring_llm, PASSAGE[:90]
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3, logprob_start=40)
    engine = llm.generate([ids], params)[0]
    reference = generate.generate_one(llm.engine.params, llm.model_config, ids, params, seed=0, eos_id=llm.tokenizer.eos_id)
    assert reference.token_ids == engine.token_ids == [] and reference.finish_reason == engine.finish_reason == "length"
    assert reference.prompt_logprobs[:40] == engine.prompt_logprobs[:40] == [None] * 40
    for mine, ref in zip(engine.prompt_logprobs[40:], reference.prompt_logprobs[40:]):
        assert abs(mine[0] - ref[0]) < 1e-4 and list(mine[1]) == list(ref[1])  # f32, two attention paths


def test_a_text_continuation_after_token_ids_gets_no_bos(tiny_scoring_llm):
    llm = tiny_scoring_llm
    context_ids = llm.encode("The cat")
    _, continuation_ids = encode_pair(llm, context_ids, " sat")
    assert continuation_ids == llm.tokenizer.encode(" sat", add_bos=False)
    assert llm.tokenizer.bos_id is None or continuation_ids[0] != llm.tokenizer.bos_id


def test_many_contexts_run_in_batches_that_fit_the_pool_and_keep_every_context_shared(tiny_scoring_llm, tiny_uncached_llm):
    """Six 500-token contexts (32 pages each) against half a 257-page pool: two batches, every pair served
    from its context's cached pages, the scores those of uncached prompt logprobs, in input order."""
    from jaxinfer.scoring import _batches, score_pairs

    llm = tiny_scoring_llm
    contexts = [PASSAGE[i : i + 500] for i in range(0, 6 * 16, 16)]  # distinct from their first page on
    pairs = [(contexts[i % 6], PASSAGE[500 + i : 503 + i]) for i in range(12)]  # pairs of a context are not adjacent
    assert [sorted(batch) for batch in _batches(llm, pairs)] == [[0, 1, 2, 3, 6, 7, 8, 9], [4, 5, 10, 11]]
    llm.reset_prefix_cache()
    results = score_pairs(llm, pairs)
    assert all(r.num_cached_tokens == 496 for r in results)
    for (context, continuation), result in zip(pairs[:3], results[:3]):
        out = tiny_uncached_llm.generate([context + continuation], SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0, logprob_start=len(context)))[0]
        np.testing.assert_allclose(result.token_logprobs, [lp for lp, _ in out.prompt_logprobs[len(context) :]], atol=1e-5, rtol=0)


def test_a_pair_of_exactly_max_context_tokens_is_scored_and_one_more_is_refused(tiny_scoring_llm):
    from jaxinfer.engine import generate
    from jaxinfer.validation import FieldError

    llm, limit = tiny_scoring_llm, tiny_scoring_llm.engine_config.max_context
    ids = (PASSAGE * (limit // len(PASSAGE) + 1))[:limit]
    (result,) = llm.score(ids[:-4], [ids[-4:]])
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0)
    reference = generate.generate_one(llm.engine.params, llm.model_config, ids, params, seed=0, eos_id=llm.tokenizer.eos_id)
    np.testing.assert_allclose(result.token_logprobs, [lp for lp, _ in reference.prompt_logprobs[-4:]], atol=1e-4, rtol=0)
    with pytest.raises(FieldError, match=rf"of pair 0: {limit - 2} \+ 4 tokens do not fit the context of {limit}"):
        llm.score(ids[:-3] + ids[:1], [ids[-4:]])  # limit + 1 tokens
