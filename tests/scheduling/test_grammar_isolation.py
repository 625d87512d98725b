"""The grammar check runs in a child process (grammar_check.py): a grammar deep enough to overflow
llguidance's native stack kills the child, never this process, and is that request's FieldError naming the
crash; a spec that passes the check compiles here and gives a usable mask, or a guide whose error names
llguidance's refusal (the request's error)."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxinfer import SamplingParams
from jaxinfer.scheduling import grammar_check, guided
from jaxinfer.validation import FieldError


def defs_chain_schema(depth: int) -> dict:
    """A JSON schema whose `$defs` are a chain: object d{i} has one required property referring to d{i + 1}."""
    defs = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["next"]} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(depth: int, width: int = 1) -> str:
    """A Lark grammar of `depth` rules, each naming the next (with `width` alternatives), ending in "a"."""
    alternatives = lambda i: " | ".join([f"r{i + 1}"] + [f'"{chr(98 + k)}" r{i + 1}' for k in range(width - 1)])  # noqa: E731
    return "\n".join(["start: r0", *(f"r{i}: {alternatives(i)}" for i in range(depth)), f'r{depth}: "a"'])


def allowed_ids(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in a mask row (bit t % 32 of word t // 32)."""
    tokens = np.arange(vocab_size)
    return np.flatnonzero((words[tokens // 32] >> (tokens % 32)) & 1)


@pytest.fixture(scope="module")
def guides(smollm2_tokenizer):
    return guided.Guides(smollm2_tokenizer, smollm2_tokenizer.vocab_size)


@pytest.mark.parametrize("spec", [{"json": defs_chain_schema(1000)}, {"grammar": lark_chain(4000)}], ids=["defs_chain_1000", "lark_chain_4000"])
def test_a_grammar_that_crashes_the_checker_is_a_field_error_naming_the_crash(spec):
    assert len(json.dumps(spec)) > 30_000  # the sizes users sent: 100 KB of schema, 50 KB of Lark
    with pytest.raises(FieldError) as e:
        SamplingParams(structured_outputs=spec)
    assert e.value.field == "structured_outputs"
    assert "too deep or too large: the grammar checker crashed (signal 11, SIGSEGV)" in str(e.value), str(e.value)


def test_the_checker_starts_a_fresh_worker_after_a_crash_and_checks_each_spec_once():
    checker = grammar_check.GrammarChecker()
    try:
        assert "crashed" in checker.check("grammar", lark_chain(4000))
        assert checker.check("regex", "[0-9]{3}") is None  # a new worker answers
        assert "crashed" in checker.check("grammar", lark_chain(4000))  # cached: not sent again
        assert checker.check("regex", "[0-9]{3}") is None
        assert checker.num_checks == 2
    finally:
        checker.close()


def test_a_check_past_its_timeout_is_an_error_and_the_worker_is_replaced():
    checker = grammar_check.GrammarChecker(timeout_s=0.05)
    try:
        error = checker.check("choice", json.dumps([f"option {i}" for i in range(40_000)]))  # about 4 s to compile
        assert error == "the grammar check took over 0.05 s (too large or too deep)"
        checker.timeout_s = 60.0
        assert checker.check("regex", "ab") is None
    finally:
        checker.close()


def test_a_chain_just_below_the_crash_depth_compiles_here_and_masks_like_a_shallow_one(guides, smollm2_tokenizer):
    """The check's stack is 8 MiB, the in-process compile's 64 MiB: a chain the check passes compiles here,
    and its first mask allows exactly the tokens of the one-rule grammar start: "a" (the same language)."""
    vocab = smollm2_tokenizer.vocab_size
    masks = {}
    for depth in (0, 2000):
        guide = guides.guide(SamplingParams(structured_outputs={"grammar": lark_chain(depth)}))
        masks[depth] = np.full(guided.mask_words(vocab), -1, np.int32)
        guide.fill_mask(masks[depth])
        assert guide.error is None
    texts = {smollm2_tokenizer.decode([int(t)]) for t in allowed_ids(masks[2000], vocab)}
    assert texts == {"a"} and (masks[0] == masks[2000]).all()


def nested_arrays(depth: int) -> dict:
    """A schema of `depth` nested arrays around a null, built without recursion (json.loads of the text would
    itself overflow the interpreter's C recursion limit near 1,000 levels, failing the generator, not the code)."""
    schema: dict = {"type": "null"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


# Specs of every kind, shaped by depth, width, recursion and size: each gives a request or a FieldError.
_DEPTHS = st.one_of(st.integers(0, 50), st.integers(2000, 6000))  # shallow, or near and past the crash depth
_SPECS = st.one_of(
    st.builds(lambda d, w: {"grammar": lark_chain(d, w)}, _DEPTHS, st.integers(1, 3)),
    st.builds(lambda d: {"grammar": "\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(d)), f'r{d} ::= "a"'])}, _DEPTHS),
    st.builds(lambda d, recursive: {"json": {**defs_chain_schema(d), **({"properties": {"self": {"$ref": "#"}}} if recursive else {})}},
              st.one_of(st.integers(0, 50), st.integers(500, 1500)), st.booleans()),
    st.builds(lambda d: {"json": nested_arrays(d)}, st.integers(0, 3000)),
    st.builds(lambda d: {"regex": "(" * d + "a" + ")" * d}, st.integers(0, 3000)),
    st.builds(lambda texts: {"choice": texts}, st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=300)),
    st.builds(lambda text: {"grammar": text}, st.text(max_size=200)),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=_SPECS)
def test_fuzzed_specs_give_a_request_or_a_field_error_and_the_checker_never_dies_unnoticed(guides, smollm2_tokenizer, spec):
    checker = grammar_check.CHECKER
    checks_before = checker.num_checks
    try:
        params = SamplingParams(structured_outputs=spec)
    except FieldError as e:
        event("crashed" if "crashed" in str(e) else "refused")
        assert e.field == "structured_outputs"
        # A worker that died took the spec with it, and the error says so: it never passes silently.
        assert checker._process is not None or "crashed" in str(e) or "took over" in str(e), str(e)
        return
    event("accepted")
    if checker.num_checks > checks_before:  # checked now, not an answer cached from an earlier example
        assert checker._process is not None and checker._process.poll() is None  # the worker that passed it is alive
    guide = guides.guide(params)  # compiled in this process: a crash here would end the test run
    row = np.full(guided.mask_words(smollm2_tokenizer.vocab_size), -1, np.int32)
    guide.fill_mask(row)
    if guide.error is not None:  # llguidance's own limits with the real vocabulary (too many items): this request's error
        event("matcher error")
        assert guide.error.startswith("the grammar"), guide.error
        return
    assert allowed_ids(row, smollm2_tokenizer.vocab_size).size > 0


def test_a_schema_nested_past_python_s_recursion_limit_is_the_field_s_error():
    """json.dumps of a 10,000-deep dict raises RecursionError: that is structured_outputs' error, not a crash."""
    schema = {"type": "integer"}
    for _ in range(10_000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(FieldError, match="nested too deeply") as error:
        SamplingParams(structured_outputs={"json": schema})
    assert error.value.field == "structured_outputs"
