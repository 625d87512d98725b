"""The GGUF-built tokenizer against llama.cpp's ids for the same file, and chat templates."""

import json

import pytest

from conftest import FIXTURES

CASES = [json.loads(line) for line in (FIXTURES / "smollm2_tokenization.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_encode_matches_llama_cpp_when_same_gguf(smollm2_tokenizer, case):
    assert smollm2_tokenizer.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_decode_round_trips_when_llama_cpp_ids(smollm2_tokenizer, case):
    assert smollm2_tokenizer.decode(case["ids"]) == case["text"]


def test_digits_split_one_by_one_when_smollm_pre_tokenizer(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("2026")
    assert [smollm2_tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "6"]


def test_special_ids_when_gguf_metadata(smollm2_tokenizer):
    assert (smollm2_tokenizer.bos_id, smollm2_tokenizer.eos_id) == (1, 2)
    assert smollm2_tokenizer.decode([2]) == "<|im_end|>"


def test_chat_template_renders_system_default_when_no_system_message(smollm2_tokenizer):
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert smollm2_tokenizer.encode("<|im_start|>")[0] == 1  # control token matched whole


def test_chat_template_rejects_malformed_messages(smollm2_tokenizer):
    with pytest.raises(ValueError, match="message 0"):
        smollm2_tokenizer.apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError, match="non-empty list"):
        smollm2_tokenizer.apply_chat_template([])
