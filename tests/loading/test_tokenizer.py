"""The GGUF-built tokenizers against llama.cpp's ids for the same files, and chat templates.

- SmolLM2 (the embedded model): ids llama.cpp gave for 30 strings (tests/fixtures/smollm2_tokenization.jsonl).
- llama.cpp's own vocabulary-only GGUFs and reference tokenizations (.inp/.out, from the llama-cpp-python
  sdist, fetched into build/ once): Llama 2 / Mistral SentencePiece, Llama 3, Qwen2, Phi-3.
- Chat templates of each family against transformers' rendering (tests/fixtures/chat_templates.json).
"""

import dataclasses
import functools
import json
import re

import pytest

import gguf_files
from conftest import FIXTURES
from jaxinfer.loading.tokenizer import load_tokenizer

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


# ---------------------------------------------------------------- llama.cpp's vocabularies and reference tokenizations
VOCABS = ("llama-spm", "llama-bpe", "qwen2", "phi-3")  # Llama 2 / Mistral, Llama 3, Qwen2.5 / Qwen3, Phi-3 (SentencePiece)
_SEPARATOR = "\n__ggml_vocab_test__\n"  # how llama.cpp's test-tokenizer-0 splits a .inp file
CHAT = json.loads((FIXTURES / "chat_templates.json").read_text(encoding="utf-8"))


MODELS = gguf_files.llama_cpp_models()


@functools.cache
def vocab_tokenizer_of(vocab: str):
    """The tokenizer of llama.cpp's ggml-vocab-<vocab>.gguf, built once per session (Llama 3's takes ~10 s)."""
    return load_tokenizer(MODELS / f"ggml-vocab-{vocab}.gguf")


def llama_cpp_cases(vocab: str) -> list[tuple[str, list[int]]]:
    """(text, ids) of every test in llama.cpp's ggml-vocab-<vocab>.gguf.inp / .out pair."""
    texts = (MODELS / f"ggml-vocab-{vocab}.gguf.inp").read_text(encoding="utf-8").split(_SEPARATOR)
    lines = (MODELS / f"ggml-vocab-{vocab}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert texts[-1] == "" and lines[-1] == "" and len(texts) == len(lines), vocab
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts[:-1], lines[:-1])]


@pytest.fixture(scope="module", params=VOCABS)
def vocab_tokenizer(request):
    return request.param, vocab_tokenizer_of(request.param)


def test_encode_reproduces_every_llama_cpp_reference_line(vocab_tokenizer):
    vocab, tokenizer = vocab_tokenizer
    cases = llama_cpp_cases(vocab)
    assert len(cases) >= 40
    wrong = [(text, ids) for text, ids in cases if tokenizer.encode(text, add_bos=False, parse_special=False) != ids]
    assert not wrong, f"{vocab}: {len(wrong)} of {len(cases)} differ, first {wrong[0][0]!r}"


def test_decode_round_trips_llama_cpp_reference_ids(vocab_tokenizer):
    vocab, tokenizer = vocab_tokenizer
    wrong = [text for text, ids in llama_cpp_cases(vocab) if tokenizer.decode(ids) != text]
    assert not wrong, f"{vocab}: {len(wrong)} texts do not round-trip, first {wrong[0]!r}"


@pytest.mark.parametrize("vocab", ["llama-spm", "phi-3"])
def test_control_sentencepiece_without_space_prefix_misses_llama_cpp(vocab):
    """The ▁ prefix matters: the same vocabulary without it disagrees with llama.cpp on most lines."""
    from tokenizers import normalizers

    tokenizer = vocab_tokenizer_of(vocab)
    bare = tokenizer.tokenizer.from_str(tokenizer.tokenizer.to_str())
    bare.normalizer = normalizers.Replace(" ", "\u2581")
    cases = llama_cpp_cases(vocab)
    wrong = sum(bare.encode(text, add_special_tokens=False).ids != ids for text, ids in cases if text.strip())
    assert wrong > len(cases) // 2


def test_bos_is_added_as_the_metadata_says():
    spm = vocab_tokenizer_of("llama-spm")  # tokenizer.ggml.add_bos_token = true
    assert spm.encode("Hello") == [1, 15043] and spm.encode("Hello", add_bos=False) == [15043]
    qwen = vocab_tokenizer_of("qwen2")  # no add_bos_token key: byte-level BPE adds none
    assert qwen.encode("Hello") == qwen.encode("Hello", add_bos=False)


def test_unknown_pre_tokenizer_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"ggml-vocab-qwen35.gguf: unsupported GGUF pre-tokenizer 'qwen35' \(tokenizer.ggml.pre\)"):
        load_tokenizer(MODELS / "ggml-vocab-qwen35.gguf")


def test_gguf_without_tokenizer_is_an_error_naming_the_file(tmp_path):
    import gguf_convert

    path = gguf_convert.convert(FIXTURES / "tiny_qwen3", tmp_path / "no-tokenizer.gguf")
    with pytest.raises(ValueError, match="no-tokenizer.gguf: the GGUF has no tokenizer"):
        load_tokenizer(path)


@pytest.mark.parametrize("config, first", [({}, "bos"), ({"add_bos_token": False}, "text"), ({"add_bos_token": True}, "bos")])
def test_an_hf_folder_puts_its_bos_first_as_its_tokenizer_json_does_unless_its_config_says(tmp_path, config, first):
    """Llama 3's tokenizer_config.json has no add_bos_token: its tokenizer.json's post-processor puts <|begin_of_text|>
    first, as transformers and vLLM encode it (and the GGUF of the same model does)."""
    from tokenizers import Tokenizer, processors

    inner = load_tokenizer().tokenizer
    bos = "<|endoftext|>"
    inner.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, inner.token_to_id(bos))])
    inner.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": bos} | config))
    reference = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("Hello there", add_special_tokens=True).ids
    assert reference[0] == inner.token_to_id(bos)
    ids = load_tokenizer(tmp_path).encode("Hello there")
    assert ids == (reference if first == "bos" else reference[1:])


def test_hf_folder_without_tokenizer_json_is_an_error_naming_it():
    with pytest.raises(ValueError, match="tiny_qwen2: no tokenizer.json"):
        load_tokenizer(FIXTURES / "tiny_qwen2")


@pytest.fixture(scope="module")
def template_tokenizers():
    return {vocab: vocab_tokenizer_of(vocab) for vocab in {case["vocab"] for case in CHAT["cases"]}}


@pytest.mark.parametrize("template", list(CHAT["templates"]))
def test_chat_template_renders_as_transformers_does(template_tokenizers, template):
    """Llama 2/3.x, Mistral and Qwen2.5/3 templates, bos/eos from the family's vocab GGUF, with and
    without add_generation_prompt; a conversation the template refuses is refused here too."""
    for case in [c for c in CHAT["cases"] if c["template"] == template]:
        tokenizer = dataclasses.replace(template_tokenizers[case["vocab"]], chat_template=CHAT["templates"][template])
        assert (tokenizer._token_text(tokenizer.bos_id), tokenizer._token_text(tokenizer.eos_id)) == (case["bos_token"], case["eos_token"])
        messages = CHAT["conversations"][case["conversation"]]
        render = functools.partial(tokenizer.apply_chat_template, messages, add_generation_prompt=case["add_generation_prompt"], date_string=CHAT["date_string"])
        if "error" in case:
            with pytest.raises(ValueError, match=re.escape(case["error"])):
                render()
        else:
            assert render() == case["rendered"], (template, case["conversation"], case["add_generation_prompt"])


def test_a_message_the_template_reads_as_another_shape_is_a_value_error_naming_the_template(template_tokenizers):
    """Llama 3.1's template reads an assistant message's tool_calls[i].function; a tool call without one is refused with a
    ValueError (a batch line's error record), not jinja2's UndefinedError (which stopped a job)."""
    case = next(c for c in CHAT["cases"] if c["template"] == "llama-3.1")
    tokenizer = dataclasses.replace(template_tokenizers[case["vocab"]], chat_template=CHAT["templates"]["llama-3.1"])
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [{}]}, {"role": "user", "content": "go on"}]
    with pytest.raises(ValueError, match="the chat template cannot render these messages: UndefinedError"):
        tokenizer.apply_chat_template(messages, date_string=CHAT["date_string"])


def test_chat_template_from_the_gguf_metadata_is_used():
    qwen = vocab_tokenizer_of("qwen2")
    text = qwen.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert qwen.encode(text, add_bos=False).count(qwen.tokenizer.token_to_id("<|im_start|>")) == text.count("<|im_start|>")


# ---------------------------------------------------------------- llama-cpp-python on longer varied texts

LLAMA_CPP = json.loads((FIXTURES / "llama_cpp_tokenization.json").read_text(encoding="utf-8"))  # make_llama_cpp_fixtures.py


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("text", list(LLAMA_CPP["texts"]))
def test_encode_equals_llama_cpp_python_on_varied_text(vocab, text):
    """Ids llama-cpp-python 0.3.36 gave for code, unicode, digits and whitespace runs, without and with
    the BOS its metadata (or llama.cpp's default) asks for."""
    tokenizer, expected = vocab_tokenizer_of(vocab), LLAMA_CPP["vocabs"][vocab][text]
    content = LLAMA_CPP["texts"][text]
    assert tokenizer.encode(content, add_bos=False, parse_special=False) == expected["ids"]
    assert tokenizer.encode(content, parse_special=False) == expected["ids_with_bos"]
    assert tokenizer.decode(expected["ids"]) == content


@pytest.mark.parametrize("vocab", list(LLAMA_CPP["chat_texts"]))
def test_control_tokens_in_text_match_llama_cpp_python_when_parse_special(vocab):
    tokenizer, text = vocab_tokenizer_of(vocab), LLAMA_CPP["chat_texts"][vocab]
    ids = tokenizer.encode(text, add_bos=False)
    assert ids == LLAMA_CPP["vocabs"][vocab]["chat"]["ids"]
    assert tokenizer.encode(text, add_bos=False, parse_special=False) != ids  # as plain text they split up


def test_an_hf_folders_chat_template_is_read_as_transformers_reads_it(tmp_path):
    """chat_template.jinja (where transformers now saves it) first; else tokenizer_config.json's, a string or a list
    of named templates (the 'default' one)."""
    import shutil

    from jaxinfer.loading.tiny_model import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "m", load_tokenizer())
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template = config.pop("chat_template")
    config_path.write_text(json.dumps(config))
    assert load_tokenizer(folder).chat_template is None
    (folder / "chat_template.jinja").write_text(template)
    assert load_tokenizer(folder).chat_template == template
    (folder / "chat_template.jinja").unlink()
    config_path.write_text(json.dumps(config | {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]}))
    assert load_tokenizer(folder).chat_template == template
    config_path.write_text(json.dumps(config | {"chat_template": [{"name": "tool_use", "template": "x"}]}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: chat_template is a list of named templates without one named 'default'"):
        load_tokenizer(folder)
    shutil.copy(folder / "tokenizer.json", tmp_path / "whole.json")
    (folder / "tokenizer.json").write_bytes((tmp_path / "whole.json").read_bytes()[:1000])  # an interrupted download
    with pytest.raises(ValueError, match=r"m/tokenizer.json: cannot read the tokenizer"):
        load_tokenizer(folder)
    (folder / "tokenizer.json").write_bytes((tmp_path / "whole.json").read_bytes())
    config_path.write_text('{"bos_token": ')
    with pytest.raises(ValueError, match=r"m/tokenizer_config.json: cannot read it"):
        load_tokenizer(folder)


def test_damaged_gguf_tokenizer_metadata_is_an_error_naming_the_file(tmp_path):
    import gguf

    path = tmp_path / "damaged.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("tokenizer.ggml.model", "gpt2")  # its tokens and merges are missing
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"damaged.gguf: the GGUF's tokenizer metadata cannot be read \(TypeError"):
        load_tokenizer(path)
