"""A Hugging Face folder without a tokenizer (config.json + safetensors: the usual tiny random test model)
loads in LLM and runs on token ids; text gives an error naming the folder and the missing tokenizer.

The model is tests/fixtures/tiny_qwen2_yarn (no tokenizer.json); its greedy continuation with transformers'
cache (tests/reference/make_fixtures.py) is the reference the token ids must equal.
"""

import numpy as np
import pytest

from conftest import FIXTURES
from jaxinfer.scheduling.request import SamplingParams

FOLDER = FIXTURES / "tiny_qwen2_yarn"
DATA = np.load(FIXTURES / "tiny_qwen2_yarn_reference.npz")


@pytest.fixture(scope="module")
def llm(compile_cache):
    from jaxinfer.api import LLM

    assert not (FOLDER / "tokenizer.json").exists()
    return LLM(str(FOLDER), compilation_cache_dir=compile_cache, dtype="float32", quantization=None, attention_impl="reference",
               matmul_impl="xla", max_context=64, page_size=16, max_num_seqs=2, max_prefill_tokens=32,
               prefill_chunk_buckets=(32,), decode_batch_buckets=(2,), decode_page_buckets=(4,))


def test_generate_on_token_ids_equals_transformers_greedy(llm):
    prompt = DATA["g_prompt_ids"].tolist()
    out = llm.generate([prompt, np.asarray(prompt)], SamplingParams(temperature=0, max_tokens=len(DATA["g_ids"])))
    for o in out:
        assert o.token_ids == DATA["g_ids"].tolist() and o.text == "" and o.finish_reason == "length"


@pytest.mark.parametrize("call", ["generate", "chat", "encode"])
def test_text_is_an_error_naming_the_missing_tokenizer(llm, call):
    with pytest.raises(ValueError, match=f"{FOLDER} has no tokenizer \\(no tokenizer.json\\), so this model takes token ids, not text"):
        if call == "generate":
            llm.generate(["Hello"], SamplingParams(max_tokens=2))
        elif call == "chat":
            llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=2))
        else:
            llm.encode("Hello")


@pytest.mark.parametrize("field", [{"stop": ("a",)}, {"bad_words": ("a",)}, {"structured_outputs": ("regex", "[0-9]+")}])
def test_parameters_that_need_text_are_refused_naming_the_field_and_the_missing_tokenizer(llm, field):
    # without a tokenizer an output has no text: a stop string never matched (the request ran to max_tokens), a bad
    # word failed inside the stream
    name = next(iter(field))
    with pytest.raises(ValueError, match=rf"prompt 0: {name} needs text: {FOLDER} has no tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, **field))


def test_a_gguf_without_tokenizer_metadata_runs_on_token_ids_as_its_folder_does(tmp_path, compile_cache):
    """A folder's weights (tiny_qwen3, no tokenizer either) written as a GGUF without tokenizer.ggml metadata: LLM loads
    it (it used to fail after loading the weights, telling the user to pass token ids to an LLM it never made), its
    greedy ids are the folder's, and text is an error naming the file."""
    import gguf_convert

    from jaxinfer.api import LLM

    engine = dict(compilation_cache_dir=compile_cache, dtype="float32", quantization=None, attention_impl="reference", matmul_impl="xla", max_context=64,
                  page_size=16, max_num_seqs=2, max_prefill_tokens=32, prefill_chunk_buckets=(32,), decode_batch_buckets=(2,), decode_page_buckets=(4,))
    path = gguf_convert.convert(FIXTURES / "tiny_qwen3", tmp_path / "no-tokenizer.gguf")
    prompt, params = [5, 17, 42, 7, 99, 3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (expected,) = LLM(str(FIXTURES / "tiny_qwen3"), **engine).generate([prompt], params)
    from_gguf = LLM(str(path), **engine)
    assert from_gguf.generate([prompt], params)[0].token_ids == expected.token_ids and len(expected.token_ids) == 8
    with pytest.raises(ValueError, match=r"no-tokenizer.gguf has no tokenizer \(no tokenizer.ggml metadata\), so this model takes token ids"):
        from_gguf.generate(["Hello"], SamplingParams(max_tokens=2))


@pytest.mark.slow
def test_tune_measures_a_model_without_a_tokenizer_on_token_ids(tmp_path):
    import os
    import subprocess
    import sys

    flags = ["--max-context", "64", "--page-size", "16", "--max-num-seqs", "2", "--max-prefill-tokens", "32"]
    result = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "tune", "--model", str(FOLDER), *flags], capture_output=True, text=True,
                            timeout=600, env=os.environ | {"JAXINFER_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0 and "tuned in" in result.stdout, result.stderr[-1500:]  # it used to refuse: "no tokenizer.json"
