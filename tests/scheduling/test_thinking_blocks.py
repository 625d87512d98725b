"""Reasoning output on the host (no jax): the thinking tags found in a real tokenizer's vocabulary, where a
request starts relative to its block, the budget that forces the close tag, the split of a text into
reasoning and answer, and a grammar that masks and consumes only the tokens after the block closes."""

import subprocess
import sys

import numpy as np
import pytest

from jaxinfer.scheduling import guided, reasoning
from jaxinfer.scheduling.request import Request, SamplingParams
from jaxinfer.scheduling.stopping import OutputProcessor
from jaxinfer.validation import FieldError
from thinking_model import thinking_tokenizer

TAGS = reasoning.ThinkTokens(open_id=7, close_id=8, open_text="<think>", close_text="</think>")


@pytest.fixture(scope="module")
def thinker(smollm2_tokenizer):
    return thinking_tokenizer(smollm2_tokenizer)


def allowed(row: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])


def test_the_think_tags_are_found_as_single_tokens_and_a_model_without_them_does_not_think(thinker, smollm2_tokenizer):
    tags = reasoning.think_tokens(thinker.tokenizer.token_to_id)
    assert (tags.open_text, tags.close_text) == ("<think>", "</think>")
    assert thinker.encode("<think>", add_bos=False) == [tags.open_id] and thinker.encode("</think>", add_bos=False) == [tags.close_id]
    assert reasoning.think_tokens(smollm2_tokenizer.tokenizer.token_to_id) is None
    assert guided.Guides(smollm2_tokenizer, smollm2_tokenizer.vocab_size).request_fields(SamplingParams(thinking_budget=3), [1, 2]) == {"guide": None, "thinking": None}


@pytest.mark.parametrize("prompt, state", [([1, 7, 5], reasoning.THINKING), ([1, 7, 5, 8, 5], reasoning.ANSWER), ([1, 5], reasoning.BEFORE), ([8, 7], reasoning.THINKING)])
def test_a_request_starts_where_its_prompts_last_tag_leaves_it(prompt, state):
    assert reasoning.start_state(TAGS, prompt) == state


def test_the_budget_forces_the_close_tag_after_that_many_thinking_tokens_and_then_lets_go():
    thinking = reasoning.thinking_for(TAGS, [1, 7], budget=3)
    forced = []
    for token in (20, 21, 22, 8, 30):
        forced.append(thinking.forced_token)
        thinking.advance(token)
    assert forced == [None, None, None, 8, None] and thinking.num_thinking_tokens == 3 and thinking.state == reasoning.ANSWER
    assert reasoning.thinking_for(TAGS, [1, 7], budget=0).forced_token == 8  # budget 0 closes at once
    assert reasoning.thinking_for(TAGS, [1], budget=0).forced_token is None  # not inside a block yet


def test_a_first_token_that_opens_the_block_is_thinking_and_any_other_is_the_answer():
    opened, plain = reasoning.thinking_for(TAGS, [1], None), reasoning.thinking_for(TAGS, [1], None)
    opened.advance(7)
    plain.advance(30)
    assert (opened.state, opened.last_was_thinking, opened.num_thinking_tokens) == (reasoning.THINKING, True, 0)
    assert (plain.state, plain.last_was_thinking) == (reasoning.ANSWER, False)


def _after(prompt, tokens):
    thinking = reasoning.thinking_for(TAGS, prompt, None)
    for token in tokens:
        thinking.advance(token)
    return thinking


@pytest.mark.parametrize("prompt, tokens, text, expected", [
    ([7], [20, 8, 30], "\nsome thought</think>{\"a\": 1}", ("\nsome thought", "{\"a\": 1}")),  # the template opened it
    ([1], [7, 20, 8, 30], "<think>why</think>answer", ("why", "answer")),  # the model opened it
    ([7], [20, 21], "cut off while thinking", ("cut off while thinking", "")),  # never closed: all reasoning
    ([7, 8], [30], "plain</think> answer", (None, "plain</think> answer")),  # the prompt closed it (enable_thinking false)
    ([1], [30, 8], "no block</think>", (None, "no block</think>")),  # the first token did not open one
])
def test_a_text_splits_into_reasoning_and_answer_at_the_close_tag(prompt, tokens, text, expected):
    assert reasoning.split(text, _after(prompt, tokens)) == expected
    assert reasoning.split(text, None) == (None, text)


@pytest.mark.parametrize("bad", [-1, "5", 2.5, True])
def test_a_bad_thinking_budget_is_a_field_error_naming_it(bad):
    with pytest.raises(FieldError) as e:
        SamplingParams(thinking_budget=bad)
    assert e.value.field == "thinking_budget"


def test_the_grammar_applies_only_after_the_block_closes_and_the_budget_closes_it(thinker):
    """Inside the block any token but EOS may come (the grammar is not asked and not fed); at the budget only
    </think>; after it only what the JSON grammar allows, and the grammar then finishes the request."""
    vocab = thinker.vocab_size
    guides = guided.Guides(thinker, vocab)
    prompt = thinker.encode_chat([{"role": "user", "content": "Pick."}])
    params = SamplingParams(max_tokens=64, thinking_budget=2, structured_outputs={"json": {"enum": ["yes"]}})
    request = Request("0", prompt, params, seed=0, eos_id=thinker.eos_id, **guides.request_fields(params, prompt))
    tags, processor = guides.think_tokens, OutputProcessor(lambda ids: thinker.decode(ids, skip_special=True), thinker.eos_id, 512)
    words = guided.mask_words(vocab)
    hello = thinker.encode(" hello", add_bos=False)[0]
    for step, token in enumerate([hello, hello, tags.close_id, *thinker.encode('"yes"', add_bos=False)]):
        row = np.full(words, -1, np.int32)
        guided.fill_mask(row, request.guide, request.next_token_bans())
        ids = allowed(row, vocab)
        if step < 2:
            assert hello in ids and thinker.eos_id not in ids and len(ids) == vocab - 1, step
        elif step == 2:
            assert ids.tolist() == [tags.close_id]
        else:
            assert hello not in ids and token in ids and len(ids) < 100, (step, len(ids))
        request.output_ids.append(int(token))
        reason = processor.check(request)
    assert reason == "stop" and request.error is None
    assert reasoning.split(processor.text(request), request.thinking) == (" hello hello", '"yes"')


def test_the_reasoning_module_imports_no_jax():
    code = "import sys, jaxinfer.scheduling.reasoning, jaxinfer.outputs; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
