"""Chat request options users bring from vLLM/OpenAI: content as a list of text parts, chat_template_kwargs
(Qwen3's enable_thinking), add_generation_prompt and continue_final_message."""

import dataclasses
import json

import pytest

from conftest import FIXTURES
from jaxinfer import LLM, SamplingParams
from jaxinfer.validation import FieldError

QWEN3 = json.loads((FIXTURES / "chat_templates.json").read_text(encoding="utf-8"))["templates"]["qwen3"]
TINY_ENGINE = dict(max_context=128, page_size=8, max_num_seqs=2, max_prefill_tokens=64, prefill_chunk_buckets=(64,), decode_batch_buckets=(2,), decode_page_buckets=(16,))
TALK = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "The capital is"}]


@pytest.fixture(scope="module")
def llm(tiny_chat_model, compile_cache):
    return LLM(str(tiny_chat_model), compilation_cache_dir=compile_cache, **TINY_ENGINE)


def test_text_parts_are_joined_as_vllm_joins_them(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}]
    assert llm.encode_chat(parts) == llm.encode_chat([{"role": "user", "content": "What is the capital\nof France?"}])
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].*only text"):
        llm.encode_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_continue_final_message_ends_the_prompt_inside_the_last_message(llm):
    text = llm.tokenizer.decode(llm.encode_chat(TALK, add_generation_prompt=False, continue_final_message=True))
    assert text.endswith("<|im_start|>assistant\nThe capital is")
    closed = llm.tokenizer.decode(llm.encode_chat(TALK, add_generation_prompt=False))
    assert closed.endswith("The capital is<|im_end|>\n")
    opened = llm.tokenizer.decode(llm.encode_chat(TALK))
    assert opened.endswith("<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="cannot both be set"):
        llm.encode_chat(TALK, continue_final_message=True)
    out = llm.chat(TALK, SamplingParams(temperature=0, max_tokens=3), add_generation_prompt=False, continue_final_message=True)[0]
    assert out.num_prompt_tokens == len(llm.encode_chat(TALK, add_generation_prompt=False, continue_final_message=True))


def test_chat_template_kwargs_reach_the_template(llm):
    """Qwen3's template opens an empty think block when enable_thinking is false (its own text)."""
    qwen = dataclasses.replace(llm.tokenizer, chat_template=QWEN3)
    user = TALK[:1]
    assert qwen.apply_chat_template(user, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen.apply_chat_template(user).endswith("<|im_start|>assistant\n")
    with pytest.raises(FieldError, match="chat_template_kwargs"):
        llm.encode_chat(user, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(FieldError, match="chat_template_kwargs"):
        llm.encode_chat(user, chat_template_kwargs=["enable_thinking"])
