"""Output processing: incremental detokenization equals decoding all ids at once, and stop handling."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.scheduling.stopping import IncrementalDetokenizer, OutputProcessor
from jaxinfer.scheduling.request import Request, SamplingParams


@pytest.fixture(scope="module")
def decode(smollm2_tokenizer):
    return lambda ids: smollm2_tokenizer.decode(ids, skip_special=True)


def incremental_text(decode, ids, chunk_sizes):
    detok, emitted, i = IncrementalDetokenizer(decode), [], 0
    for size in chunk_sizes:
        emitted.append(detok.add(ids[i : i + size]))
        i += size
    emitted.append(detok.add(ids[i:]))
    emitted.append(detok.flush())
    assert "".join(emitted) == detok.text
    return detok.text


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=40), chunks=st.lists(st.integers(1, 3), max_size=40))
def test_incremental_text_equals_full_decode_for_random_ids(decode, ids, chunks):
    assert incremental_text(decode, ids, chunks) == decode(ids)


@pytest.mark.parametrize("text", ["Hello, world!", "naïve café — 東京 😀 ok", "  spaces\n\nand\ttabs ", "<|im_end|> after a special"])
def test_incremental_text_equals_full_decode_for_real_text_token_by_token(decode, smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    assert incremental_text(decode, ids, [1] * len(ids)) == decode(ids)


def test_multibyte_character_split_over_byte_tokens_is_held_back_until_complete(decode, smollm2_tokenizer):
    ids = [smollm2_tokenizer.tokenizer.token_to_id(t) for t in ("ðŁ", "ĺ", "Ģ")]  # the bytes of U+1F600, one per token
    if None in ids or decode(ids) != "😀":
        pytest.skip("this vocabulary has no byte tokens for U+1F600")
    detok = IncrementalDetokenizer(decode)
    assert [detok.add([t]) for t in ids] == ["", "", "😀"]


def test_work_per_token_is_bounded_not_quadratic(decode, smollm2_tokenizer):
    calls = []
    counting = lambda ids: calls.append(len(ids)) or decode(ids)  # noqa: E731
    detok = IncrementalDetokenizer(counting)
    ids = smollm2_tokenizer.encode("word " * 400)
    for t in ids:
        detok.add([t])
    assert max(calls) <= 4, f"a step decoded {max(calls)} ids"  # a window, never the whole output


def request_with(output_ids, **params) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(**params), seed=0, output_ids=list(output_ids))


def checked_until_it_ends(processor: OutputProcessor, request: Request, ids: list[int]) -> list:
    """The processor's verdict after each of `ids` is generated, up to the first that ends the request."""
    reasons = []
    for t in ids:
        request.output_ids.append(t)
        reasons.append(processor.check(request))
        if reasons[-1]:
            break
    return reasons


def test_stop_string_cuts_text_before_it_and_ends_the_request(decode, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("one two three four five")
    processor = OutputProcessor(decode, eos_id=None, max_context=100)
    request = request_with([], stop=(" three",), max_tokens=50)
    reasons = checked_until_it_ends(processor, request, ids)
    assert reasons[-1] == "stop" and reasons[:-1] == [None] * (len(reasons) - 1)
    assert processor.text(request) == "one two"


def test_no_stop_string_is_looked_for_until_min_tokens_are_out_nor_one_completed_before(decode, smollm2_tokenizer):
    """vLLM's rule: with min_tokens 4, the " two" inside the first 4 tokens does not stop the request, nor is it matched
    later; the next " two", after them, does."""
    ids = smollm2_tokenizer.encode("one two three four five six two seven", add_bos=False)
    assert len(smollm2_tokenizer.encode("one two", add_bos=False)) <= 4  # the first " two" lies within min_tokens
    processor = OutputProcessor(decode, eos_id=None, max_context=100)
    request = request_with([], stop=(" two",), max_tokens=50, min_tokens=4)
    reasons = checked_until_it_ends(processor, request, ids)
    assert reasons[-1] == "stop" and len(reasons) == len(smollm2_tokenizer.encode("one two three four five six two", add_bos=False))
    assert processor.text(request) == "one two three four five six"


def test_stop_string_spanning_tokens_is_found(decode, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("abcdefgh")
    processor = OutputProcessor(decode, None, 100)
    request = request_with([], stop=("cdef",), max_tokens=50)
    found = False
    for t in ids:
        request.output_ids.append(t)
        found = processor.check(request) == "stop"
        if found:
            break
    assert found and processor.text(request) == "ab"


@pytest.mark.parametrize(
    "output, params, eos, context, reason",
    [
        ([5, 9], dict(max_tokens=10), 9, 100, "stop"),  # EOS
        ([5, 9], dict(max_tokens=10, ignore_eos=True), 9, 100, None),
        ([5, 7], dict(max_tokens=10, stop_token_ids=(7,)), 9, 100, "stop"),
        ([5, 6], dict(max_tokens=2), 9, 100, "length"),
        ([5, 6], dict(max_tokens=10), 9, 5, "length"),  # 3 prompt + 2 output tokens fill a context of 5
        ([5, 6], dict(max_tokens=10), 9, 6, None),
    ],
)
def test_token_level_stop_rules(output, params, eos, context, reason):
    assert OutputProcessor(None, eos, context).check(request_with(output, **params)) == reason


def test_text_of_a_request_that_never_ran_is_empty_and_state_is_released(decode):
    processor = OutputProcessor(decode, None, 10)
    assert processor.text(request_with([])) == ""
    assert processor._texts == {}
