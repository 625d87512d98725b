"""The dense reference generator (engine/generate.py) honours every SamplingParams field, or refuses it.

One case per field, enumerated from the dataclass, so a new field without a case fails here. Each case runs
a request through `generate()` and through the paged engine (LLM.generate) on the tiny chat model (random
weights, SmolLM2's real tokenizer) and asserts that the outputs are equal, plus the field's effect against
a control (the same request without it) or a hand-computed value: logit_bias forcing a token, min_tokens
delaying EOS, bad_words never appearing, top_k=1 giving the greedy output... The fields that act on text
need a tokenizer; without one, `generate()` refuses them with a FieldError naming the field.
"""

import dataclasses

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.generate import TEXT_FIELDS, generate
from jaxinfer.validation import FieldError

TINY_ENGINE = dict(
    max_context=128, page_size=8, max_num_seqs=4, max_prefill_tokens=32, prefill_chunk_buckets=(32,),
    decode_batch_buckets=(4,), decode_page_buckets=(16,),
)
BASE = SamplingParams(temperature=0, max_tokens=12)
PROMPT = "The quick brown fox"
LOGPROB_TOLERANCE = 1e-4  # paged (engine) against dense (reference) attention, f32


class Runs:
    """One request through the engine and through the reference, on the same model, seed and tokenizer."""

    def __init__(self, llm: LLM):
        self.llm, self.tokenizer, self.eos_id = llm, llm.tokenizer, llm.tokenizer.eos_id
        self.prompt = llm.tokenizer.encode(PROMPT)

    def engine(self, sp: SamplingParams):
        (out,) = self.llm.generate([self.prompt], sp)
        return out

    def reference(self, sp: SamplingParams, *, tokenizer: bool = True):
        (out,) = generate(self.llm.engine.params, self.llm.model_config, [self.prompt], sp, seed=self.llm.engine_config.seed,
                          eos_id=self.eos_id, tokenizer=self.tokenizer if tokenizer else None)
        return out

    def both(self, sp: SamplingParams):
        """(engine output, reference output), asserting equal tokens, finish reason and text."""
        engine, reference = self.engine(sp), self.reference(sp)
        assert reference.token_ids == engine.token_ids, (sp, engine.token_ids, reference.token_ids)
        assert (reference.finish_reason, reference.text, reference.error) == (engine.finish_reason, engine.text, engine.error)
        return engine, reference


@pytest.fixture(scope="module")
def runs(tiny_chat_model, compile_cache) -> Runs:
    return Runs(LLM(str(tiny_chat_model), compilation_cache_dir=compile_cache, max_logprobs=5, max_logit_bias=16, **TINY_ENGINE))


@pytest.fixture(scope="module")
def greedy(runs):
    """The reference's greedy output of BASE (the control most cases compare with)."""
    out = runs.reference(BASE)
    assert len(set(out.token_ids)) == len(out.token_ids) == BASE.max_tokens and runs.eos_id not in out.token_ids
    return out


def _with(**fields) -> SamplingParams:
    return dataclasses.replace(BASE, **fields)


def _sampled_cut_gives_greedy(runs, greedy, **cut):
    """A cut that keeps only the most likely token makes a hot draw greedy; the same draw without it is not."""
    _, out = runs.both(_with(temperature=1.5, seed=3, **cut))
    assert out.token_ids == greedy.token_ids
    assert runs.reference(_with(temperature=1.5, seed=3)).token_ids != greedy.token_ids  # control


def case_temperature(runs, greedy):
    _, out = runs.both(_with(temperature=1.0, seed=5))
    assert out.token_ids != greedy.token_ids


def case_top_k(runs, greedy):
    _sampled_cut_gives_greedy(runs, greedy, top_k=1)


def case_top_p(runs, greedy):
    _sampled_cut_gives_greedy(runs, greedy, top_p=1e-6)


def case_min_p(runs, greedy):
    _sampled_cut_gives_greedy(runs, greedy, min_p=1.0)


def case_seed(runs, greedy):
    _, first = runs.both(_with(temperature=1.0, seed=11))
    _, second = runs.both(_with(temperature=1.0, seed=12))
    assert first.token_ids != second.token_ids


def case_max_tokens(runs, greedy):
    _, out = runs.both(_with(max_tokens=3))
    assert (out.token_ids, out.finish_reason) == (greedy.token_ids[:3], "length")


def case_stop_token_ids(runs, greedy):
    _, out = runs.both(_with(stop_token_ids=(greedy.token_ids[4],)))
    assert (out.token_ids, out.finish_reason) == (greedy.token_ids[:5], "stop")  # the stop token is kept


def _stop_string(greedy) -> str:
    """Text the greedy output holds from its fifth token on: its first characters."""
    return greedy.text[len(greedy.text) // 2 :][:4]


def case_stop(runs, greedy):
    stop = _stop_string(greedy)
    _, out = runs.both(_with(stop=(stop,)))
    assert out.finish_reason == "stop" and out.text == greedy.text[: greedy.text.index(stop)]


def case_include_stop_str_in_output(runs, greedy):
    stop = _stop_string(greedy)
    _, out = runs.both(_with(stop=(stop,), include_stop_str_in_output=True))
    assert out.text == greedy.text[: greedy.text.index(stop) + len(stop)]


def case_ignore_eos(runs, greedy):
    forced = {runs.eos_id: 100.0}
    _, stopped = runs.both(_with(logit_bias=forced))
    assert (stopped.token_ids, stopped.finish_reason) == ([runs.eos_id], "stop")
    _, out = runs.both(_with(logit_bias=forced, ignore_eos=True))
    assert (out.token_ids, out.finish_reason) == ([runs.eos_id] * BASE.max_tokens, "length")


def case_min_tokens(runs, greedy):
    _, out = runs.both(_with(logit_bias={runs.eos_id: 100.0}, min_tokens=3))
    assert runs.eos_id not in out.token_ids[:3] and out.token_ids[3:] == [runs.eos_id] and out.finish_reason == "stop"


def _penalty_changes_a_forced_repeat(runs, greedy, **penalty):
    """A bias of 8 on the first greedy token brings it back once more in 12 tokens; a penalty of 2 on
    what was generated keeps it from coming back."""
    repeated = runs.reference(_with(logit_bias={greedy.token_ids[0]: 8.0}))
    assert repeated.token_ids.count(greedy.token_ids[0]) == 2  # control
    _, out = runs.both(_with(logit_bias={greedy.token_ids[0]: 8.0}, **penalty))
    assert out.token_ids.count(greedy.token_ids[0]) == 1


def case_presence_penalty(runs, greedy):
    _penalty_changes_a_forced_repeat(runs, greedy, presence_penalty=2.0)


def case_frequency_penalty(runs, greedy):
    _penalty_changes_a_forced_repeat(runs, greedy, frequency_penalty=2.0)


def case_repetition_penalty(runs, greedy):
    _penalty_changes_a_forced_repeat(runs, greedy, repetition_penalty=2.0)


def case_logit_bias(runs, greedy):
    forced = greedy.token_ids[5]
    _, out = runs.both(_with(logit_bias={forced: 100.0}))
    assert out.token_ids == [forced] * BASE.max_tokens


def _assert_close(engine_entries, reference_entries):
    assert len(engine_entries) == len(reference_entries)
    for want, got in zip(engine_entries, reference_entries):
        if want is None:
            assert got is None
            continue
        assert list(got[1]) == list(want[1])  # the same top ids, in the same order
        np.testing.assert_allclose([got[0], *got[1].values()], [want[0], *want[1].values()], atol=LOGPROB_TOLERANCE)


def case_logprobs(runs, greedy):
    engine, out = runs.both(_with(temperature=1.0, seed=2, logprobs=3))
    assert len(out.logprobs) == len(out.token_ids) and all(len(top) == 3 for _, top in out.logprobs)
    _assert_close(engine.logprobs, out.logprobs)
    assert greedy.logprobs is None  # control


def case_prompt_logprobs(runs, greedy):
    engine, out = runs.both(_with(prompt_logprobs=2))
    assert len(out.prompt_logprobs) == len(runs.prompt) and out.prompt_logprobs[0] is None
    _assert_close(engine.prompt_logprobs, out.prompt_logprobs)
    assert greedy.prompt_logprobs is None  # control


def case_pooling(runs, greedy):
    """An embedding request (LLM.embed's: pooling, max_tokens=0) is the paged engine's: it returns the pooled
    prompt and no tokens; the reference generator computes tokens only and refuses it, naming the field."""
    sp = _with(pooling="last", max_tokens=0)
    engine = runs.engine(sp)
    assert engine.token_ids == [] and engine.embedding.shape == (runs.llm.model_config.embed_dim,)
    assert greedy.token_ids  # control: the same prompt without pooling generates
    with pytest.raises(FieldError, match="pooling"):
        runs.reference(sp)


def case_logprob_start(runs, greedy):
    engine, out = runs.both(_with(prompt_logprobs=2, logprob_start=3, max_tokens=0))
    assert out.token_ids == [] and out.prompt_logprobs[:3] == [None] * 3 and all(e is not None for e in out.prompt_logprobs[3:])
    _assert_close(engine.prompt_logprobs[3:], out.prompt_logprobs[3:])


def case_n(runs, greedy):
    engine, out = runs.both(_with(temperature=1.0, n=3))
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in engine.samples]
    assert len({tuple(s.token_ids) for s in out.samples}) == 3


def case_structured_outputs(runs, greedy):
    _, out = runs.both(_with(temperature=1.0, structured_outputs={"choice": ["yes", "no", "maybe"]}))
    assert out.text in ("yes", "no", "maybe") and out.finish_reason == "stop"


def case_thinking_budget(runs, greedy):
    """SmolLM2's vocabulary has no thinking tags: the budget has no block to close, in both (the thinking
    model's case is tests/front/test_reasoning.py's)."""
    _, out = runs.both(_with(thinking_budget=0))
    assert out.token_ids == greedy.token_ids


def case_allowed_token_ids(runs, greedy):
    allowed = (greedy.token_ids[7], greedy.token_ids[3], 100)
    _, out = runs.both(_with(allowed_token_ids=allowed))
    assert set(out.token_ids) <= set(allowed) and out.token_ids != greedy.token_ids


def _contains(ids: list[int], run: list[int]) -> bool:
    return any(ids[i : i + len(run)] == run for i in range(len(ids) - len(run) + 1))


def case_bad_words(runs, greedy):
    """vLLM's rule, written out: a word is banned as it is written at the start and after a space."""
    token = next(t for t in greedy.token_ids[1:] if runs.tokenizer.decode([t]).startswith(" ") and runs.tokenizer.decode([t]).strip().isalpha())
    word = runs.tokenizer.decode([token]).strip()
    _, out = runs.both(_with(bad_words=(word,)))
    for text in (word, " " + word):
        assert not _contains(out.token_ids, runs.tokenizer.encode(text, add_bos=False, parse_special=False))
    assert _contains(greedy.token_ids, [token])  # control: the greedy output holds it


CASES = {name.removeprefix("case_"): case for name, case in dict(globals()).items() if name.startswith("case_")}
FIELDS = [field.name for field in dataclasses.fields(SamplingParams)]


def test_every_sampling_field_has_a_case():
    missing = sorted(set(FIELDS) - set(CASES))
    assert not missing, f"SamplingParams fields with no case showing generate() honours or refuses them: {missing}"
    assert set(CASES) <= set(FIELDS)


@pytest.mark.parametrize("field", FIELDS)
def test_reference_honours_the_field_as_the_engine_does(field, runs, greedy):
    if field not in CASES:
        pytest.fail(f"no case for SamplingParams.{field}: show that generate() honours it (equal to the engine) or refuses it")
    CASES[field](runs, greedy)


def test_constraints_that_leave_no_token_end_in_the_engines_error(runs):
    """allowed_token_ids = (EOS,) while min_tokens bans EOS: no token may be drawn, an error naming both."""
    _, out = runs.both(_with(allowed_token_ids=(runs.eos_id,), min_tokens=1))
    assert (out.token_ids, out.finish_reason) == ([], "error")
    assert "allowed_token_ids" in out.error and "min_tokens" in out.error


TEXT_VALUES = {"stop": ("fox",), "bad_words": ("fox",), "structured_outputs": {"choice": ["yes", "no"]}}


@pytest.mark.parametrize("field", TEXT_FIELDS)
def test_text_fields_without_a_tokenizer_are_refused_naming_the_field(field, runs):
    with pytest.raises(FieldError) as error:
        runs.reference(_with(**{field: TEXT_VALUES[field]}), tokenizer=False)
    assert error.value.field == field


def test_every_other_field_runs_without_a_tokenizer(runs, greedy):
    """Token-level fields need no tokenizer: the output is the one with a tokenizer, and text is empty."""
    sp = _with(logit_bias={greedy.token_ids[0]: 8.0}, frequency_penalty=2.0, min_tokens=2, allowed_token_ids=tuple(greedy.token_ids))
    without, with_tokenizer = runs.reference(sp, tokenizer=False), runs.reference(sp)
    assert without.token_ids == with_tokenizer.token_ids and without.text == ""


@pytest.mark.parametrize("fields, name", [
    ({"logit_bias": {10**6: 1.0}}, "logit_bias"), ({"stop_token_ids": (10**6,)}, "stop_token_ids"), ({"allowed_token_ids": (10**6,)}, "allowed_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(fields, name, runs):
    with pytest.raises(FieldError) as error:
        runs.reference(_with(**fields))
    assert error.value.field == name
