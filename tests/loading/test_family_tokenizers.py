"""The Gemma 4 tokenizer built from GGUF metadata against llama.cpp, and the Gemma chat templates.

- llama.cpp's ggml-vocab-gemma-4.gguf and its reference tokenizations (.inp/.out, from the llama-cpp-python
  0.3.36 sdist, fetched into build/ once by tests/reference/fetch_llama_cpp_models.py);
- ids llama-cpp-python gave on the same file for longer varied texts, and the Gemma chat templates
  rendered by transformers (tests/fixtures/gemma_tokenizer.json, make_family_tokenizer_fixtures.py).
"""

import dataclasses
import json
import re

import pytest

import gguf_files
from conftest import FIXTURES
from jaxinfer.loading.tokenizer import load_tokenizer

_SEPARATOR = "\n__ggml_vocab_test__\n"  # how llama.cpp's test-tokenizer-0 splits a .inp file
REFERENCE = json.loads((FIXTURES / "gemma_tokenizer.json").read_text(encoding="utf-8"))


MODELS = gguf_files.llama_cpp_models()


@pytest.fixture(scope="module")
def gemma4():
    return load_tokenizer(MODELS / "ggml-vocab-gemma-4.gguf")


def _llama_cpp_cases() -> list[tuple[str, list[int]]]:
    texts = (MODELS / "ggml-vocab-gemma-4.gguf.inp").read_text(encoding="utf-8").split(_SEPARATOR)
    lines = (MODELS / "ggml-vocab-gemma-4.gguf.out").read_text(encoding="utf-8").split("\n")
    texts = texts[:-1] if texts[-1] == "" else texts  # this .inp has no separator after its last text
    assert lines[-1] == "" and len(texts) == len(lines) - 1
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines[:-1])]


def test_gemma4_encode_reproduces_every_llama_cpp_reference_line(gemma4):
    cases = _llama_cpp_cases()
    assert len(cases) >= 40
    wrong = [(text, ids) for text, ids in cases if gemma4.encode(text, add_bos=False, parse_special=False) != ids]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, first {wrong[0][0]!r}"


def test_gemma4_decode_round_trips_llama_cpp_reference_ids(gemma4):
    wrong = [text for text, ids in _llama_cpp_cases() if gemma4.decode(ids) != text]
    assert not wrong, f"{len(wrong)} texts do not round-trip, first {wrong[0]!r}"


def test_gemma4_newline_run_in_the_vocabulary_is_one_token(gemma4):
    """llama.cpp takes a run of newlines that is a token whole; longer runs split into such tokens."""
    vocab = gemma4.tokenizer.get_vocab()
    runs = {len(t): i for t, i in vocab.items() if t and set(t) == {"\n"}}
    assert len(runs) >= 16
    for length, token_id in runs.items():
        assert gemma4.encode("x" + "\n" * length + "y", add_bos=False)[1:-1] == [token_id], length
    longest = max(runs)
    assert gemma4.encode("\n" * (longest + 1), add_bos=False) != [runs[longest]]
    assert gemma4.decode(gemma4.encode("\n" * (longest + 1), add_bos=False)) == "\n" * (longest + 1)


def test_gemma4_characters_outside_the_vocabulary_fall_back_to_byte_tokens(gemma4):
    vocab = gemma4.tokenizer.get_vocab()
    char = next(chr(c) for c in range(0x10000, 0x10FFFF) if chr(c) not in vocab and chr(c).isprintable())
    expected = [vocab[f"<0x{b:02X}>"] for b in char.encode()]
    assert gemma4.encode(char, add_bos=False) == expected
    assert gemma4.decode(expected) == char


def test_gemma4_adds_bos_and_matches_control_tokens_when_parse_special(gemma4):
    assert gemma4.bos_id == 2 and gemma4.eos_id == 1 and gemma4.add_bos
    assert gemma4.encode("Hello")[0] == 2 and gemma4.encode("Hello", add_bos=False)[0] != 2
    text = "<|turn>user\nHi<turn|>"
    assert gemma4.encode(text, add_bos=False)[0] == 105 and gemma4.encode(text, add_bos=False)[-1] == 106
    assert 105 not in gemma4.encode(text, add_bos=False, parse_special=False)


def test_gemma4_bos_is_added_even_when_the_metadata_says_not(tmp_path):
    """llama.cpp overrides add_bos_token=false for Gemma 4 (the model needs BOS); so does jaxinfer."""
    import gguf

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "ab", "\u2581", "\u2581ab"]
    writer = gguf.GGUFWriter(tmp_path / "tiny-gemma4-vocab.gguf", "gemma4")
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3, 3] + [1] * 5)
    writer.add_token_merges(["a b", "\u2581 ab"])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(False)
    gguf_files.finish(writer)
    tokenizer = load_tokenizer(tmp_path / "tiny-gemma4-vocab.gguf")
    assert tokenizer.encode("ab ab") == [2, 6, 8]


@pytest.mark.skipif("llama_cpp" not in REFERENCE, reason="gemma_tokenizer.json was made without llama-cpp-python (make setup-bench)")
@pytest.mark.parametrize("name", ["long", "code", "spaces", "digits"])
def test_gemma4_encode_equals_llama_cpp_python_on_varied_text(gemma4, name):
    text, expected = REFERENCE["llama_cpp"]["texts"][name], REFERENCE["llama_cpp"]["ids"][name]
    assert gemma4.encode(text, add_bos=False, parse_special=False) == expected["ids"]
    assert gemma4.encode(text, parse_special=False) == expected["ids_with_bos"]
    assert gemma4.decode(expected["ids"]) == text


@pytest.mark.skipif("llama_cpp" not in REFERENCE, reason="gemma_tokenizer.json was made without llama-cpp-python (make setup-bench)")
def test_gemma4_chat_control_tokens_equal_llama_cpp_python(gemma4):
    reference = REFERENCE["llama_cpp"]
    assert gemma4.encode(reference["chat_text"], add_bos=False) == reference["chat_ids"]


@pytest.mark.parametrize("template", list(REFERENCE["chat"]["templates"]))
def test_gemma_chat_template_renders_as_transformers_does(gemma4, template):
    """The template in the Gemma 4 GGUF's metadata and llama.cpp's Gemma 4 and Gemma 2 templates, with
    and without the generation prompt; Gemma 2 refuses a system message, and so do we."""
    chat = REFERENCE["chat"]
    tokenizer = dataclasses.replace(gemma4, chat_template=chat["templates"][template])
    assert (tokenizer._token_text(tokenizer.bos_id), tokenizer._token_text(tokenizer.eos_id)) == (chat["bos_token"], chat["eos_token"])
    for case in [c for c in chat["cases"] if c["template"] == template]:
        messages = chat["conversations"][case["conversation"]]
        render = lambda: tokenizer.apply_chat_template(messages, add_generation_prompt=case["add_generation_prompt"], date_string=chat["date_string"])  # noqa: E731
        if "error" in case:
            with pytest.raises(ValueError, match=re.escape(case["error"])):
                render()
        else:
            assert render() == case["rendered"], (template, case["conversation"], case["add_generation_prompt"])


def test_gemma4_chat_from_gguf_metadata_encodes_with_one_bos(gemma4):
    """The template writes <bos> itself; encode_chat adds no second one (as transformers and llama.cpp)."""
    assert gemma4.chat_template == REFERENCE["chat"]["templates"]["gguf-gemma-4"]
    messages = [{"role": "user", "content": "Hi"}]
    ids = gemma4.encode_chat(messages)
    assert ids.count(gemma4.bos_id) == 1 and ids[:3] == [2, 105, gemma4.tokenizer.token_to_id("user")]
    assert ids == gemma4.encode(gemma4.apply_chat_template(messages), add_bos=False)
