"""The API's validation boundary on a tiny real-vocabulary model: every bad value is a clear error
naming it, raised before any work; every valid one runs to completion (never a hang or a crash)."""

import math
import signal
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_CHAT_ENGINE
from jaxinfer.api import LLM
from jaxinfer.scheduling.request import truncate_prompt
from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.request import SamplingParams
from jaxinfer.validation import FieldError

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(tiny_chat_model, compile_cache):
    return LLM(tiny_chat_model, compilation_cache_dir=compile_cache, **TINY_CHAT_ENGINE)


@contextmanager
def time_limit(seconds: int):
    """Turn a hang into a failure."""

    def fail(*_):
        raise AssertionError(f"did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("bad", [49152, 10**6, -1, 2**31, 2**63, 1.0, True, "5"])
def test_out_of_range_or_mistyped_token_ids_are_errors_naming_them(llm, bad):
    with pytest.raises(ValueError, match=rf"prompt 0: prompt holds {bad!r} at index 1; token ids must be integers in \[0, 49152\)"):
        llm.generate([[5, bad, 7]], GREEDY)


def test_the_largest_valid_token_id_runs(llm):
    (out,) = llm.generate([[5, 49151]], GREEDY)
    assert out.num_generated_tokens == 4


def test_numpy_token_id_prompts_run_as_their_list_of_ints(llm):
    (expected,) = llm.generate([[5, 6, 7]], GREEDY)
    cases = [
        np.array([5, 6, 7]),  # one 1-D array: one prompt
        [np.array([5, 6, 7], dtype=np.int32)],  # a list of arrays
        [np.int64(5), np.int64(6), np.int64(7)],  # numpy ints as one prompt's ids
        [[np.int64(5), 6, np.uint16(7)]],
        np.array([[5, 6, 7]]),  # a 2-D array: one prompt per row
    ]
    for prompts in cases:
        (out,) = llm.generate(prompts, GREEDY)
        assert out.prompt_token_ids == [5, 6, 7] and out.token_ids == expected.token_ids, prompts


@pytest.mark.parametrize(
    "prompts, message",
    [
        ([np.array([5.0, 6.0])], r"prompt 0: prompt must be text or token ids .*float64"),
        ([np.array([[5, 6]])], r"prompt 0: prompt must be text or token ids .*2-D"),
        ([np.array([5, 49152])], r"prompt 0: prompt holds 49152 at index 1"),
        (np.zeros((1, 2, 2), dtype=np.int64), r"prompts must be .*3-D"),
        (b"Hello", r"prompt 0: prompt must be text or a list of token ids, got bytes: decode it to str"),  # not the ids 72, 101, ...
        ([b"a", bytearray(b"b")], r"prompt 0: prompt must be text or a list of token ids, got bytes"),
    ],
)
def test_numpy_prompts_that_are_not_token_ids_are_errors_naming_the_prompt(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, GREEDY)


def test_any_64_bit_seed_is_taken_as_openai_and_vllm_take_it_folded_into_the_devices_range_by_one_rule():
    from jaxinfer.batch.input import parse

    assert SamplingParams(seed=7).seed == 7 and SamplingParams(seed=2**31 - 1).seed == 2**31 - 1
    folded = {seed: SamplingParams(seed=seed).seed for seed in (2**31, 2**63 - 1, -1, -(2**63))}
    assert all(0 <= s < 2**31 for s in folded.values()) and len(set(folded.values())) == 4
    line = '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "seed": 9223372036854775807}}'
    fields, _ = parse(line, "openai")
    assert SamplingParams.from_fields({"seed": fields["seed"]}).seed == folded[2**63 - 1]  # an OpenAI line, a jaxinfer line and the API alike


def test_a_params_entry_of_the_wrong_type_names_its_prompt(llm):
    with pytest.raises(TypeError, match=r"prompt 1: expected SamplingParams, got dict"):
        llm.generate(["a", "b"], [GREEDY, {"temperature": 0}])


def test_stop_token_ids_outside_the_vocabulary_are_errors(llm):
    with pytest.raises(ValueError, match="stop_token_ids holds 49152"):
        llm.generate("hello", SamplingParams(stop_token_ids=(49152,)))


def test_lone_surrogate_in_text_or_chat_is_an_error(llm):
    with pytest.raises(ValueError, match="lone surrogate"):
        llm.generate("a\ud800b", GREEDY)
    with pytest.raises(ValueError, match=r"messages\[0\].content holds a lone surrogate"):
        llm.chat([{"role": "user", "content": "\udfff"}], GREEDY)


def test_zero_sequences_is_an_error_at_construction_not_a_hang():
    with time_limit(10), pytest.raises(FieldError, match="max_num_seqs must be >= 1, got 0"):
        LLM(max_num_seqs=0, num_pages=100)


def test_misspelt_engine_field_gets_a_close_match_hint():
    with pytest.raises(FieldError, match="did you mean 'max_num_seqs'"):
        LLM(max_num_seq=4)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(temperature=math.nan), "temperature must be a finite number"),
        (dict(temperature=math.inf), "temperature must be a finite number"),
        (dict(top_k=2**31), "top_k must be in"),
        (dict(top_k=1.5), "top_k must be an integer"),
        (dict(top_p=0.0), "top_p must be a finite number in (0, 1]"),
        (dict(seed=True), "seed must be an integer"),
        (dict(seed=2**64), "seed must be in [-9223372036854775808, 18446744073709551615]"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(stop=("",)), "stop must hold non-empty strings"),
        (dict(stop=(1,)), "stop must hold non-empty strings"),
        (dict(stop_token_ids=("5",)), "stop_token_ids must be an integer"),
        (dict(stop_token_ids=(1.5,)), "stop_token_ids must be an integer"),
        (dict(ignore_eos="yes"), "ignore_eos must be true or false"),
        (dict(structured_outputs=("json", "{bad")), "structured_outputs holds '{bad', which is not JSON"),
    ],
)
def test_bad_sampling_params_name_the_field(fields, message):
    with pytest.raises(FieldError, match=message.replace("(", r"\(").replace("[", r"\[")):
        SamplingParams(**fields)


def test_truncate_never_cuts_a_prompt_that_fits_and_keeps_half_when_output_is_huge():
    ids = list(range(100))
    assert truncate_prompt(ids, 2048, 2000, "left") == ids
    assert truncate_prompt(list(range(300)), 256, 2000, "left") == list(range(172, 300))  # half the context
    assert truncate_prompt(list(range(300)), 256, 50, "right") == list(range(206))  # room for 50 tokens
    with pytest.raises(FieldError, match="truncate must be one of"):
        truncate_prompt(ids, 10, 1, "middle")


REAL_TEXT = "\n\n".join(path.read_text() for path in [Path(__file__).parents[2] / "README.md", *sorted((Path(__file__).parents[2] / "docs").glob("*.md"))])
LONG_WORD = "".join(np.random.default_rng(0).choice(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/"), 60_000))  # a base64 blob


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("shape", ["prose", "cut_in_a_long_word", "kept_in_a_long_word", "repeated_letter"])
def test_truncate_tokenizes_only_what_it_keeps_and_keeps_the_same_tokens(llm, monkeypatch, side, shape):
    limit = (llm.engine_config.max_context + 64) * llm.tokenizer.max_token_chars  # the part of the text tokenized
    body = (REAL_TEXT * (1 + 3 * limit // len(REAL_TEXT)))[: 3 * limit]
    if shape == "cut_in_a_long_word":  # the part's end falls inside the word, well past the tokens kept
        word = LONG_WORD[:2000]
        text = body[: limit - 1000] + word + body if side == "right" else body + word + body[: limit - 1000]
    elif shape == "kept_in_a_long_word":  # the kept tokens and the cut are all inside one word
        text = "Hello " + LONG_WORD + " " + body if side == "right" else body + " " + LONG_WORD + " the end."
    elif shape == "repeated_letter":
        text = "Hello " + "a" * (2 * limit) + " " + body if side == "right" else body + " " + "a" * (2 * limit)
    else:
        text = body
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = truncate_prompt(llm.encode(text), llm.engine_config.max_context, params.max_tokens, side)
    seen, encode = [], type(llm.tokenizer).encode
    monkeypatch.setattr(type(llm.tokenizer), "encode", lambda self, t, **kw: seen.append(len(t)) or encode(self, t, **kw))
    prompt = llm.prepare(text, params, index=0, truncate=side)
    assert prompt.token_ids == expected and len(expected) == llm.engine_config.max_context - 16
    if shape in ("prose", "cut_in_a_long_word"):  # cut at a space in the part's far half: only that part is tokenized
        assert len(seen) == 1 and limit / 2 <= seen[0] <= limit and limit < len(text) / 2, seen
    else:  # no space where the part may be cut: the whole text, never a cut inside the word
        assert seen == [len(text)]


def test_truncated_prompt_runs(llm):
    prompt = llm.prepare("word " * 300, SamplingParams(max_tokens=500), index=0, truncate="left")
    assert len(prompt.token_ids) == 64
    (out,) = llm.stream([prompt], progress=False)
    assert out.finish_reason == "length" and out.num_prompt_tokens + out.num_generated_tokens == 128


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**40), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3), st.lists(st.integers(-2, 60000), max_size=2))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(["temperature", "top_k", "top_p", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos"]), _ANY, max_size=4))
def test_random_sampling_params_are_a_clear_error_or_a_completed_run(llm, fields):
    fields.setdefault("max_tokens", 3)
    try:
        params = SamplingParams(**fields)
    except FieldError as e:
        assert e.field in fields
        return
    with time_limit(120):
        try:
            (out,) = llm.generate(["Hello there"], params)
        except ValueError as e:
            assert "stop_token_ids" in str(e)  # ids over the vocabulary are only known to the model
            return
    assert out.finish_reason in ("stop", "length") and 1 <= out.num_generated_tokens <= params.max_tokens


_ENGINE_FIELDS = {
    "page_size": st.sampled_from([0, 8, 16, 32, -4, 2.0]),
    "max_context": st.sampled_from([0, 64, 96, 128, 100]),
    "max_num_seqs": st.sampled_from([0, 1, 3, 5, 64, True]),
    "max_prefill_tokens": st.sampled_from([0, 1, 16, 48, 64, 512]),
    "num_pages": st.sampled_from([None, 1, 2, 6, 40]),
    "prefill_seq_buckets": st.sampled_from([(1,), (1, 2), (2, 1), ()]),
    "kv_memory_fraction": st.sampled_from([0.0, 0.1, 1.5, math.nan]),
}


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fields=st.fixed_dictionaries({}, optional=_ENGINE_FIELDS))
def test_random_engine_configs_are_a_clear_error_or_a_completed_run(tiny_chat_model, compile_cache, fields):
    try:
        EngineConfig(compilation_cache_dir=compile_cache, **fields)
    except FieldError as e:
        assert e.field in fields or e.field in ("max_context", "prefill_chunk_buckets"), e
        return
    with time_limit(300):
        try:
            llm = LLM(tiny_chat_model, compilation_cache_dir=compile_cache, **fields)
        except FieldError as e:
            assert e.field == "max_context" and "exceeds the model's context of 512" in str(e)
            return
        prompts = [[5] * 3, [6] * 40]
        try:
            outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        except ValueError as e:
            assert "KV pages" in str(e) or "context is" in str(e), e  # the prompt cannot fit this engine
            return
    assert all(o.finish_reason in ("length", "stop") for o in outputs)


@pytest.mark.parametrize(("quantization", "group_size"), [("int8", 64), (None, 32), ("int4", 48), ("int4", True), ("int4", 64.0)])
def test_group_size_is_checked_at_the_boundary(quantization, group_size):
    from conftest import FIXTURES

    with pytest.raises(FieldError, match="group_size") as info:
        LLM(FIXTURES / "tiny_llama", quantization=quantization, group_size=group_size, warmup=False)
    assert info.value.field == "group_size"


def test_group_size_reaches_the_int4_weights(tiny_chat_model, capsys):
    from jaxinfer import cli

    llm = LLM(tiny_chat_model, quantization="int4", group_size=32, warmup=False, max_context=128, num_pages=4)
    assert llm.engine.params.layers.w_up.group_size == 32
    with pytest.raises(ValueError, match="'wq' .* group size 64: input dim 32"):  # the tiny model's width is 32
        LLM(tiny_chat_model, quantization="int4", group_size=64, warmup=False, max_context=128, num_pages=4)
    assert cli.main(["info", "--model", str(tiny_chat_model), "--group-size", "64"]) == 2
    assert "--group-size applies to quantization='int4' only" in capsys.readouterr().err


def test_text_a_mismatched_tokenizer_turns_into_an_id_past_the_embedding_is_an_error_naming_it(tiny_chat_model, compile_cache, tmp_path):
    """A tokenizer.json with a token added past the embedding's rows (49152 of them): its id would read another row
    (the gather clamps it); the prompt is refused, as an id prompt with that id is."""
    import shutil

    from tokenizers import AddedToken

    folder = tmp_path / "model"
    shutil.copytree(tiny_chat_model, folder)
    from jaxinfer.loading.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder).tokenizer
    tokenizer.add_special_tokens([AddedToken("<|tool|>", special=True)])
    tokenizer.save(str(folder / "tokenizer.json"))
    llm = LLM(folder, compilation_cache_dir=compile_cache, **TINY_CHAT_ENGINE)
    with pytest.raises(ValueError, match=r"prompt 0: prompt was tokenized to an id outside the model's vocabulary .* holds 49152 at index"):
        llm.generate(["Call <|tool|> now"], GREEDY)
    assert llm.generate(["Call it now"], GREEDY)[0].finish_reason in ("length", "stop")
