"""Logit processing (bias, min_tokens, the three penalties, min_p) and log-probabilities.

Each is checked against an independent reference: a numpy transcription of vLLM's definitions on random
logits, a greedy loop over the dense reference forward (conftest.padded_logits) with those definitions
applied in numpy, and HF transformers' log-softmax on the same ids (tests/fixtures/smollm2_reference.npz).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FIXTURES, padded_logits
from jaxinfer import LLM, SamplingParams
from jaxinfer.model import sampling
from jaxinfer.validation import FieldError

HF = np.load(FIXTURES / "smollm2_reference.npz")
TINY_ENGINE = dict(
    max_context=128, page_size=8, max_num_seqs=4, max_prefill_tokens=32, prefill_chunk_buckets=(32,),
    decode_batch_buckets=(4,), decode_page_buckets=(16,),
)


def numpy_process(logits, bias: dict, output_ids: list, prompt_ids: list, presence: float, frequency: float, repetition: float):
    """vLLM's order and definitions, in float64: bias; repetition over prompt + output (divide a positive
    logit, multiply a negative one); frequency x count and presence over the output."""
    x = np.asarray(logits, np.float64).copy()
    for token, value in bias.items():
        x[token] += value
    seen = set(prompt_ids) | set(output_ids)
    for token in seen:
        x[token] = x[token] / repetition if x[token] > 0 else x[token] * repetition
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=x.size) if output_ids else np.zeros(x.size)
    return x - frequency * counts - presence * (counts > 0)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1), presence=st.floats(-2, 2), frequency=st.floats(-2, 2), repetition=st.floats(0.1, 3.0),
    num_bias=st.integers(0, 4), num_output=st.integers(0, 12), num_prompt=st.integers(1, 12),
)
def test_process_matches_a_numpy_transcription_of_vllm(seed, presence, frequency, repetition, num_bias, num_output, num_prompt):
    vocab, width = 40, 6
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (2, vocab)).astype(np.float32)
    bias = {int(t): float(rng.uniform(-100, 100)) for t in rng.choice(vocab, num_bias, replace=False)}
    output_ids, prompt_ids = rng.integers(0, vocab, num_output).tolist(), rng.integers(0, vocab, num_prompt).tolist()
    bias_ids, bias_values = np.zeros((2, width), np.int32), np.zeros((2, width), np.float32)
    bias_ids[0, : len(bias)], bias_values[0, : len(bias)] = list(bias), list(bias.values())
    counts = sampling.TokenCounts(
        jnp.asarray(np.stack([np.bincount(output_ids, minlength=vocab), np.zeros(vocab)]).astype(np.int32)),
        jnp.asarray(np.stack([np.isin(np.arange(vocab), prompt_ids), np.zeros(vocab, bool)])),
    )
    arrays = sampling.SamplingArrays(
        *(np.zeros(2, np.float32),) * 5, min_p=np.zeros(2, np.float32), presence=np.array([presence, 0], np.float32),
        frequency=np.array([frequency, 0], np.float32), repetition=np.array([repetition, 1], np.float32),
        bias_ids=bias_ids, bias_values=bias_values, num_logprobs=np.full(2, -1, np.int32),
    )
    got = np.asarray(sampling.process(jnp.asarray(logits), arrays, lambda: counts))
    want = numpy_process(logits[0], bias, output_ids, prompt_ids, np.float32(presence), np.float32(frequency), np.float32(repetition))
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got[1], logits[1])  # a row without processing is untouched, bit for bit


def test_min_p_keeps_exactly_the_tokens_above_min_p_times_the_top():
    draws = 400  # one row per seed, in one call
    logits = np.log(np.tile(np.array([0.5, 0.25, 0.12, 0.08, 0.05], np.float32), (draws, 1)))
    arrays = sampling.SamplingArrays(
        np.ones(draws, np.float32), np.zeros(draws, np.int32), np.ones(draws, np.float32), np.arange(draws, dtype=np.int32),
        np.zeros(draws, np.int32), min_p=np.full(draws, 0.2, np.float32),
    )
    kept = set(np.asarray(jax.jit(sampling.next_tokens)(jnp.asarray(logits), arrays)).tolist())
    assert kept == {0, 1, 2}  # p >= 0.2 * 0.5 = 0.1: 0.5, 0.25 and 0.12 stay, 0.08 and 0.05 go


def test_sampling_fields_are_validated_and_max_completion_tokens_is_max_tokens():
    assert SamplingParams.from_fields({"max_completion_tokens": 7}).max_tokens == 7
    assert SamplingParams(logit_bias={"5": 1.5, 3: -2}).logit_bias == ((3, -2.0), (5, 1.5))
    for fields, name in [
        ({"max_completion_tokens": 7, "max_tokens": 8}, "max_completion_tokens"), ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {"a": 1}}, "logit_bias"), ({"logit_bias": {1: 101}}, "logit_bias[1]"), ({"min_p": 1.5}, "min_p"),
        ({"logprobs": -1}, "logprobs"), ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
    ]:
        with pytest.raises(FieldError) as e:
            SamplingParams.from_fields(fields)
        assert e.value.field == name, (fields, str(e.value))


@pytest.fixture(scope="module")
def tiny_llm(tiny_chat_model, compile_cache):
    return LLM(str(tiny_chat_model), compilation_cache_dir=compile_cache, max_logprobs=5, max_logit_bias=8, **TINY_ENGINE)


def test_engine_limits_are_errors_naming_the_field(tiny_llm):
    for params, name in [
        (SamplingParams(logprobs=6), "logprobs"), (SamplingParams(prompt_logprobs=6), "prompt_logprobs"),
        (SamplingParams(logit_bias={t: 1.0 for t in range(9)}), "logit_bias"),
        (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
    ]:
        with pytest.raises(FieldError) as e:
            tiny_llm.prepare("hello", params, index=0)
        assert e.value.field == name, str(e.value)
    with pytest.raises(FieldError, match=r"logit_bias holds 9 tokens; the engine's max_logit_bias is 8"):
        tiny_llm.prepare("hello", SamplingParams(logit_bias={t: 1.0 for t in range(9)}), index=0)


def reference_greedy(llm, prompt_ids: list, params: SamplingParams) -> list:
    """Greedy tokens of the dense reference forward with numpy_process applied at every step, and min_tokens
    as -inf on EOS and the stop ids."""
    cfg, params_tree, eos = llm.model_config, llm.engine.params, llm.tokenizer.eos_id
    output: list[int] = []
    while len(output) < params.max_tokens:
        logits = padded_logits(cfg, params_tree, [np.asarray(prompt_ids + output, np.int32)])[0][-1]
        bias = dict(params.logit_bias)
        if len(output) < params.min_tokens:
            bias |= {t: -math.inf for t in (*params.stop_token_ids, eos)}
        x = numpy_process(logits, bias, output, prompt_ids, params.presence_penalty, params.frequency_penalty, params.repetition_penalty)
        output.append(int(np.argmax(x)))
        if output[-1] == eos or output[-1] in params.stop_token_ids:
            break
    return output


def test_penalties_bias_and_min_tokens_match_the_reference_end_to_end(tiny_llm):
    """Greedy runs through the paged engine (chunked prefill, decode, the token history read through the
    pages) equal the reference loop; and each control changes the output, so the check can fail."""
    prompts = ["The cat sat on the mat and the cat sat on the mat", "one two three four five six seven eight nine ten eleven twelve"]
    lure = {100: 15.0, 200: 14.0}  # the random model never repeats itself; biased, it repeats these
    base = SamplingParams(temperature=0, max_tokens=12, logit_bias=lure)
    cases = [
        SamplingParams(temperature=0, max_tokens=12, logit_bias=lure, repetition_penalty=1.8),
        SamplingParams(temperature=0, max_tokens=12, logit_bias=lure, presence_penalty=1.5, frequency_penalty=0.7),
        SamplingParams(temperature=0, max_tokens=12, logit_bias={tiny_llm.tokenizer.eos_id: 30.0}, min_tokens=6),
    ]
    plain = tiny_llm.generate(prompts, base)
    assert all(o.token_ids.count(100) + o.token_ids.count(200) > 4 for o in plain)
    for params in cases:
        outputs = tiny_llm.generate(prompts, params)
        for prompt, output, base in zip(prompts, outputs, plain):
            assert output.token_ids == reference_greedy(tiny_llm, tiny_llm.encode(prompt), params), params
            assert output.token_ids != base.token_ids, f"{params} changed nothing: the check could not fail"


def test_min_tokens_masks_stop_ids_beyond_the_bias_budget_without_a_compile(tiny_llm):
    """100 stop ids under min_tokens, with a full logit_bias (max_logit_bias is 8): the bans are a mask apart
    from the bias slots, so it runs on the programs already compiled and none of them comes before min_tokens."""
    prompts = ["The cat sat on the mat", "one two three four"]
    lure = {100: 15.0, 200: 14.0} | {300 + i: 0.5 for i in range(6)}  # 8 entries; the lure makes 100 and 200 come first
    stops = (100, 200, *range(1000, 1098))
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias=lure, min_tokens=3, stop_token_ids=stops)
    unheld = tiny_llm.generate(prompts, dataclasses.replace(params, min_tokens=0))
    assert all(len(o.token_ids) == 1 and o.token_ids[0] in stops for o in unheld)  # so the check can fail
    compiled = tiny_llm.engine.num_compilations
    for prompt, output in zip(prompts, tiny_llm.generate(prompts, params)):
        assert len(output.token_ids) >= 3 and not set(output.token_ids[:3]) & set(stops), output.token_ids
        assert output.token_ids == reference_greedy(tiny_llm, tiny_llm.encode(prompt), params)
    assert tiny_llm.engine.num_compilations == compiled


def test_min_tokens_holds_off_an_eos_biased_up(smollm2_llm):
    """min_tokens=20 with EOS biased up still yields 20 tokens, then EOS."""
    llm = smollm2_llm
    eos = llm.tokenizer.eos_id
    out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=40, min_tokens=20, logit_bias={eos: 100.0}))[0]
    assert eos not in out.token_ids[:20] and out.token_ids[20:] == [eos] and out.finish_reason == "stop"
    unheld = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=40, logit_bias={eos: 100.0}))[0]
    assert unheld.token_ids == [eos]


@pytest.mark.slow
def test_logprobs_match_hf_log_softmax(smollm2_llm):
    """Generated tokens' top-20 log-probabilities (greedy) and every prompt token's (scoring) against HF's
    logits on the same ids minus their logsumexp, within 1e-4 absolute in f32."""
    llm = smollm2_llm
    for i in (0, 3, 6):
        ids, lse = HF[f"p{i}_ids"].tolist(), HF[f"p{i}_logsumexp"]
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=20, prompt_logprobs=20))[0]
        assert out.token_ids == HF[f"p{i}_greedy_ids"][:8].tolist()
        first_lp, first_top = out.logprobs[0]
        np.testing.assert_allclose(list(first_top.values()), HF[f"p{i}_greedy_top20_values"][0] - lse[-1], atol=1e-4)
        assert list(first_top) == HF[f"p{i}_greedy_top20_indices"][0].tolist()
        assert first_lp == first_top[out.token_ids[0]]
        for step, (token_lp, top) in enumerate(out.logprobs[1:], start=1):  # HF's logsumexp is not stored here: shifts
            hf_values = HF[f"p{i}_greedy_top20_values"][step]
            np.testing.assert_allclose(np.array(list(top.values())) - token_lp, hf_values - hf_values[0], atol=1e-4)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for position in range(len(ids) - 1):
            token_lp, top = out.prompt_logprobs[position + 1]
            np.testing.assert_allclose(list(top.values()), HF[f"p{i}_top20_values"][position] - lse[position], atol=1e-4)
            assert list(top) == HF[f"p{i}_top20_indices"][position].tolist()
            if ids[position + 1] in top:
                assert abs(token_lp - top[ids[position + 1]]) < 1e-6


@pytest.mark.slow
def test_prompt_logprobs_give_the_perplexity_of_the_reference_forward(smollm2_llm, smollm2_fixture_logits):
    """Perplexity of the fixtures' 601-token passage from prompt_logprobs (chunked over 64-token prefills,
    the prefix cache skipped) equals a float64 log-softmax of the dense reference logits, within 1e-4 relative."""
    llm = smollm2_llm
    ids = HF["p5_ids"].tolist()[:250]  # the small engine's context is 256
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))  # its pages are now in the prefix cache
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    ours = math.exp(-np.mean([lp for lp, _ in out.prompt_logprobs[1:]]))
    logits = smollm2_fixture_logits[5][: len(ids) - 1].astype(np.float64)
    logsumexp = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    reference = math.exp(-np.mean(logits[np.arange(len(ids) - 1), ids[1:]] - logsumexp))
    assert abs(ours - reference) / reference < 1e-4, (ours, reference)


def test_processed_logprobs_follow_the_temperature_and_the_bias(tiny_chat_model, compile_cache, tiny_llm):
    """processed = log_softmax((logits + bias) / T): between two unbiased tokens the gap is the raw gap / T."""
    processed = LLM(str(tiny_chat_model), compilation_cache_dir=compile_cache, max_logprobs=5, max_logit_bias=8, logprobs_mode="processed", **TINY_ENGINE)
    params = SamplingParams(temperature=0.5, seed=3, max_tokens=4, logprobs=5, logit_bias={7: 4.0})
    raw_out, processed_out = tiny_llm.generate(["hello there"], params)[0], processed.generate(["hello there"], params)[0]
    assert raw_out.token_ids == processed_out.token_ids  # the mode changes what is reported, not what is drawn
    compared = 0
    for (_, raw_top), (_, top) in zip(raw_out.logprobs, processed_out.logprobs):
        shared = [t for t in raw_top if t in top and t != 7]
        for a, b in zip(shared, shared[1:]):
            assert math.isclose(top[a] - top[b], (raw_top[a] - raw_top[b]) / 0.5, abs_tol=1e-3)
            compared += 1
    assert compared > 0


def test_include_stop_str_in_output_keeps_the_stop_string(tiny_llm):
    plain = tiny_llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=12))[0].text
    stop = plain[len(plain) // 2 : len(plain) // 2 + 3]
    cut = plain.index(stop)
    params = SamplingParams(temperature=0, max_tokens=12, stop=(stop,))
    assert tiny_llm.generate(["hello there"], params)[0].text == plain[:cut]
    kept = tiny_llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=12, stop=(stop,), include_stop_str_in_output=True))[0]
    assert kept.text == plain[: cut + len(stop)] and kept.finish_reason == "stop"


def test_n_samples_share_one_prompt_prefill_and_each_is_reproducible(tiny_llm):
    """n=4: one output per prompt holding 4 samples in order; samples 1-3 take every full prompt page from
    the prefix cache (the prompt is computed once); with a seed, sample 0 is the n=1 output and the
    others come back the same in another run."""
    prompt = list(range(1000, 1099))  # 99 tokens: 12 full pages of 8
    tiny_llm.reset_prefix_cache()
    out = tiny_llm.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=6, n=4))[0]
    assert [s.sample_index for s in out.samples] == [0, 1, 2, 3] and out.token_ids == out.samples[0].token_ids
    assert [s.num_cached_tokens for s in out.samples] == [0, 96, 96, 96]
    assert len({tuple(s.token_ids) for s in out.samples}) == 4
    tiny_llm.reset_prefix_cache()
    again = tiny_llm.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=6, n=4))[0]
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in out.samples]
    single = tiny_llm.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=6))[0]
    assert single.token_ids == out.samples[0].token_ids and single.samples is None
    with pytest.raises(FieldError, match="greedy"):
        SamplingParams(temperature=0, n=2)


def test_allowed_token_ids_confine_every_draw(tiny_llm):
    allowed = (100, 200, 300, tiny_llm.tokenizer.eos_id)
    free = tiny_llm.generate(["hello there"], SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))[0]
    assert not set(free.token_ids) <= set(allowed)  # so the check below can fail
    out = tiny_llm.generate(["hello there"], SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed))[0]
    assert len(out.token_ids) == 12 and set(out.token_ids) <= set(allowed)
    with pytest.raises(FieldError) as e:
        tiny_llm.prepare("hello", SamplingParams(allowed_token_ids=(10**6,)), index=0)
    assert e.value.field == "allowed_token_ids"


def test_bad_words_never_appear_and_the_rest_of_the_output_is_greedy(tiny_llm):
    """Ban a word the greedy output contains: its token sequence never appears, and the output agrees with
    the unbanned one up to the first place the ban bites (vLLM's rule: the last token of a word is masked
    where its other tokens end the output)."""
    plain = tiny_llm.generate(["The cat sat on the mat"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    word = tiny_llm.tokenizer.decode(plain.token_ids[4:6])
    banned = tiny_llm._guides._bad_word_ids((word,))
    assert any(tuple(plain.token_ids[i : i + len(ids)]) == ids for ids in banned for i in range(16))
    out = tiny_llm.generate(["The cat sat on the mat"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=(word,)))[0]
    assert not any(tuple(out.token_ids[i : i + len(ids)]) == ids for ids in banned for i in range(16)), (word, banned)
    first = next(i for i, (a, b) in enumerate(zip(out.token_ids, plain.token_ids)) if a != b)
    assert first <= 5 and out.token_ids[:first] == plain.token_ids[:first]


def test_openai_and_vllm_spellings_translate_to_one_set_of_fields():
    from_fields = SamplingParams.from_fields
    assert from_fields({"logprobs": True, "top_logprobs": 3}).logprobs == 3 and from_fields({"logprobs": False}).logprobs is None
    assert from_fields({"logprobs": 2}).logprobs == 2  # vLLM's and the completions API's integer
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    by_format = from_fields({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert by_format.structured_outputs == from_fields({"structured_outputs": {"json": schema}}).structured_outputs == from_fields({"guided_json": schema}).structured_outputs
    assert from_fields({"response_format": {"type": "json_object"}}).structured_outputs[0] == "json"
    assert from_fields({"response_format": {"type": "text"}}).structured_outputs is None
    assert from_fields({"guided_choice": ["yes", "no"]}).structured_outputs == ("choice", '["yes", "no"]')
    for fields, name in [({"top_logprobs": 2}, "top_logprobs"), ({"response_format": {"type": "xml"}}, "response_format"),
                         ({"guided_regex": "a+", "structured_outputs": {"regex": "b"}}, "guided_regex"), ({"bad_words": [""]}, "bad_words"),
                         ({"allowed_token_ids": []}, "allowed_token_ids")]:
        with pytest.raises(FieldError) as e:
            from_fields(fields)
        assert e.value.field == name, (fields, e.value)
