"""Constraints that leave nothing to generate are the request's error naming the cause, never 'stop' with
ok: a grammar with an empty language, a matcher that fails, and a step whose grammar mask, allowed_token_ids,
bad_words and min_tokens' bans together leave no token (which used to draw token 0)."""

import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.api import LLM
from jaxinfer.scheduling import guided
from jaxinfer.validation import FieldError

TINY_ENGINE = dict(
    max_context=128, page_size=8, max_num_seqs=4, max_prefill_tokens=32, prefill_chunk_buckets=(32,),
    decode_batch_buckets=(4,), decode_page_buckets=(16,),
)
EOS = 2  # SmolLM2's <|im_end|>, the tiny chat model's end of sequence


@pytest.fixture(scope="module")
def tiny_llm(tiny_chat_model, compile_cache):
    llm = LLM(str(tiny_chat_model), compilation_cache_dir=compile_cache, **TINY_ENGINE)
    assert llm.tokenizer.eos_id == EOS
    return llm


@pytest.fixture(scope="module")
def token_of(smollm2_tokenizer):
    def token(text: str) -> int:
        (token_id,) = smollm2_tokenizer.encode(text, add_bos=False, parse_special=False)
        return token_id
    return token


@pytest.mark.parametrize("spec", [
    {"grammar": 'start: x\nx: x "a"'},  # x never ends: no string
    {"regex": r"[^\x00-\x{10FFFF}]"},  # a class with no character
    {"json": {"$ref": "#"}},  # a schema that is only itself
])
def test_a_grammar_with_an_empty_language_is_a_field_error_naming_it(spec):
    with pytest.raises(FieldError) as e:
        SamplingParams(structured_outputs=spec)
    assert e.value.field == "structured_outputs" and "its language is empty" in str(e.value), str(e.value)


@pytest.mark.slow
def test_a_choice_of_100000_strings_is_a_field_error_not_a_stop():
    """llguidance panics making its matcher (over 65,525 grammar symbols); the check reports the panic."""
    with pytest.raises(FieldError) as e:
        SamplingParams(structured_outputs={"choice": [f"option number {i} xyz" for i in range(100_000)]})
    assert "cannot be compiled: panic" in str(e.value) and "symbols" in str(e.value), str(e.value)


def test_a_grammar_with_no_finite_string_ends_as_an_error_not_a_stop(tiny_llm, smollm2_tokenizer):
    """start: x / x: "a" x passes the check (every prefix "aaa…" can go on) but has no finite string: the
    matcher fails once it is asked to look ahead, and the request is that error, after its allowed tokens."""
    (out,) = tiny_llm.generate(["Say a"], SamplingParams(temperature=0, max_tokens=20, structured_outputs={"grammar": 'start: x\nx: "a" x'}))
    assert out.finish_reason == "error" and "the grammar's matcher failed after 1 tokens" in out.error, (out.finish_reason, out.error)
    assert set(smollm2_tokenizer.decode(out.token_ids)) == {"a"}


def test_allowed_eos_only_with_min_tokens_is_an_error_before_any_token(tiny_llm):
    """allowed_token_ids [EOS] with min_tokens 3 used to give [0, 0, 0, EOS]: token 0, which nothing allows."""
    (out,) = tiny_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8, min_tokens=3, allowed_token_ids=[EOS]))
    assert out.finish_reason == "error" and out.token_ids == [], (out.finish_reason, out.token_ids)
    assert out.error == "no token may follow the 0 tokens so far: allowed_token_ids + min_tokens (EOS and stop_token_ids are banned until it is reached) leave none allowed"


def test_min_tokens_leaves_the_other_allowed_token_until_it_is_reached(tiny_llm, token_of):
    """The reference by hand: allowed {t, EOS} with min_tokens 3 bans EOS for three tokens, so they are t."""
    t = token_of("cat")
    (out,) = tiny_llm.generate(["Hello"], SamplingParams(temperature=0.9, seed=3, max_tokens=6, min_tokens=3, allowed_token_ids=[t, EOS]))
    assert out.finish_reason != "error" and out.token_ids[:3] == [t, t, t] and set(out.token_ids) <= {t, EOS}, out


def test_a_grammar_that_allowed_token_ids_exclude_is_an_error_naming_both(tiny_llm, token_of):
    (out,) = tiny_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[token_of("b"), EOS], structured_outputs={"regex": "a+"}))
    assert out.finish_reason == "error" and out.token_ids == []
    assert out.error.endswith("the grammar + allowed_token_ids leave none allowed"), out.error


def test_bad_words_that_ban_the_only_allowed_token_after_some_output_is_an_error(tiny_llm, token_of):
    """allowed {dog, cat}, 'dog' banned and 'cat cat' banned: the output is cat, then nothing is left."""
    cat = token_of("cat")
    (out,) = tiny_llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[token_of("dog"), cat], bad_words=["dog", "catcat"]))
    assert out.token_ids == [cat] and out.finish_reason == "error", (out.token_ids, out.finish_reason)
    assert out.error == "no token may follow the 1 tokens so far: allowed_token_ids + bad_words leave none allowed"


def test_an_impossible_row_leaves_the_other_rows_of_its_batch_as_they_are_alone(tiny_llm):
    free = SamplingParams(temperature=0, max_tokens=10)
    alone = tiny_llm.generate(["Once upon a time"], free)[0]
    bad, good = tiny_llm.generate(["Hello", "Once upon a time"], [SamplingParams(max_tokens=8, min_tokens=3, allowed_token_ids=[EOS]), free])
    assert bad.finish_reason == "error" and good.token_ids == alone.token_ids and good.finish_reason == alone.finish_reason


def test_fill_mask_names_each_constraint_only_when_nothing_is_left():
    """Host only, no matcher: a 40-token vocabulary, allowed {3, 35}; banning one leaves the other."""
    allowed = np.packbits(np.isin(np.arange(64), [3, 35]), bitorder="little").view(np.int32)
    guide = guided.Guide(None, allowed, (), vocab_size=40)
    row = np.full(2, -1, np.int32)
    guide.fill_mask(row, banned=np.array([3]))
    assert guide.error is None and row.view(np.uint32).tolist() == [0, 1 << 3]
    row = np.full(2, -1, np.int32)
    guide.fill_mask(row, banned=np.array([3, 35]))
    assert guide.error == "no token may follow the 0 tokens so far: allowed_token_ids + min_tokens (EOS and stop_token_ids are banned until it is reached) leave none allowed"


def test_padding_bits_past_the_vocabulary_do_not_count_as_allowed():
    """Bits 40..63 of the last word are no token: a row with only those set is empty."""
    allowed = np.packbits(np.arange(64) >= 40, bitorder="little").view(np.int32)
    guide = guided.Guide(None, allowed, (), vocab_size=40)
    guide.fill_mask(np.full(2, -1, np.int32))
    assert guide.error is not None and "allowed_token_ids leave none allowed" in guide.error

