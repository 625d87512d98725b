"""Structured output (guided.py, llguidance): on the real model, every output parses and validates against
its JSON schema, regex or choice list; a schema that cannot be compiled is that request's error, and one
that crashes llguidance's checker is a batch line's error record, never the job's end."""

import json
import re
import subprocess
import sys

import jsonschema
import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.scheduling import guided
from jaxinfer.validation import FieldError
from job_records import by_key, records

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -5, "maximum": 5}}, "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["ok", "count"]},
    {"type": "object", "properties": {"owner": PERSON, "pets": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["owner", "pets"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": -10, "maximum": 10}}, "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"enum": ["France", "Spain", "Italy"]}}, "required": ["city", "country"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "label": {"type": "string", "maxLength": 12}}, "required": ["level", "label"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}, "required": ["matrix"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30}, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}, "required": ["title", "year"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"enum": ["C", "F"]}}, "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 2}}, "required": ["items"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"first": {"type": "string", "maxLength": 12}, "last": {"type": "string", "maxLength": 12}, "middle": {"type": "string", "maxLength": 12}}, "required": ["first", "last"]},
    {"type": "object", "properties": {"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]\\.[0-9]$"}}, "required": ["version"]},
    {"type": "object", "properties": {"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}, "minItems": 3, "maxItems": 3}}, "required": ["rgb"]},
    {"type": "object", "properties": {"event": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "day": {"enum": ["mon", "tue", "wed"]}}, "required": ["name", "day"]}, "attendees": {"type": "integer", "minimum": 0, "maximum": 500}}, "required": ["event", "attendees"]},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
]


def closed(schema):
    """The schema with every object closed (additionalProperties false), as users of structured output write them."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


SCHEMAS = [closed(s) for s in SCHEMAS]
PROMPTS = ["Describe a person.", "Pick a colour.", "Rate this film.", "Tag this photo.", "Count the apples.", "Describe a pet owner.",
           "Give a point.", "List some numbers.", "Name a city.", "Label a level.", "Give a small matrix.", "Name a film.",
           "Report the weather.", "Make an order.", "Answer the question.", "Name a person.", "Give a version.", "Pick a colour in RGB.",
           "Plan an event.", "Give a location.", "Pick a Greek letter.", "Pick a number."]


@pytest.mark.slow
def test_every_output_validates_against_its_schema(smollm2_llm):
    """22 schemas (nested objects, enums, arrays, number ranges, a pattern), greedy and sampled: 100% parse and validate."""
    messages = [[{"role": "user", "content": f"{p} Answer in JSON."}] for p in PROMPTS]
    for temperature in (0.0, 0.9):
        params = [SamplingParams(temperature=temperature, seed=i, max_tokens=120, structured_outputs={"json": s}) for i, s in enumerate(SCHEMAS)]
        outputs = smollm2_llm.chat(messages, params)
        for schema, output in zip(SCHEMAS, outputs):
            assert output.finish_reason == "stop", (schema, output.text)
            jsonschema.validate(json.loads(output.text), schema)


def test_regex_and_choice_hold_and_the_model_alone_does_not_follow_them(smollm2_llm):
    prompts = [[{"role": "user", "content": "Write a code."}], [{"role": "user", "content": "Pick a colour."}]]
    guided_params = [SamplingParams(temperature=0.8, seed=5, max_tokens=20, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"}),
                     SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": ["crimson", "teal", "ochre"]})]
    code, colour = smollm2_llm.chat(prompts, guided_params)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", code.text) and colour.text in ("crimson", "teal", "ochre")
    free_code, free_colour = smollm2_llm.chat(prompts, [SamplingParams(temperature=0.8, seed=5, max_tokens=20), SamplingParams(temperature=0, max_tokens=20)])
    assert not re.fullmatch(r"[0-9]{3}-[a-z]{2}", free_code.text) and free_colour.text not in ("crimson", "teal", "ochre")


def test_a_constrained_row_leaves_the_other_rows_of_its_batch_unchanged(smollm2_llm):
    prompts = ["The capital of France is", "Once upon a time"]
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = smollm2_llm.generate(prompts[1:], free)[0]
    together = smollm2_llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "[A-Z]+"}), free])
    assert together[1].token_ids == alone.token_ids and re.fullmatch("[A-Z]+", together[0].text)


def test_a_spec_that_cannot_compile_is_an_error_naming_it():
    for spec in ({"regex": "(("}, {"json": {"type": "frob"}}, {"choice": []}, {"lark": "start: x"}, {"json": {"type": "object"}, "regex": "a"}):
        with pytest.raises(FieldError) as e:
            SamplingParams(structured_outputs=spec)
        assert e.value.field == "structured_outputs"


def test_the_mask_bits_are_the_tokens_the_matcher_allows(smollm2_tokenizer):
    """fill_mask's words decode (bit t % 32 of word t // 32) to the tokens that keep the regex matchable."""
    guides = guided.Guides(smollm2_tokenizer, smollm2_tokenizer.vocab_size)
    guide = guides.guide(SamplingParams(structured_outputs={"regex": "ab"}))
    words = np.full(guided.mask_words(smollm2_tokenizer.vocab_size), -1, np.int32)
    guide.fill_mask(words)
    allowed = np.flatnonzero((words[np.arange(smollm2_tokenizer.vocab_size) // 32] >> (np.arange(smollm2_tokenizer.vocab_size) % 32)) & 1)
    texts = {smollm2_tokenizer.decode([int(t)]) for t in allowed}
    assert texts and texts <= {"a", "ab"}, texts


def test_masks_filled_during_the_forward_give_the_outputs_of_masks_filled_before_it(smollm2_llm, monkeypatch):
    """Engine.step with overlap_masks fills the grammar's masks after dispatching the forward program (the
    recorded order shows it), and the outputs, log-probabilities included, equal those with the masks filled first."""
    from jaxinfer.engine import engine as engine_lib

    engine, events = smollm2_llm.engine, []
    fill = engine_lib.token_masks
    monkeypatch.setattr(engine_lib, "token_masks", lambda plan, vocab: events.append("masks") or fill(plan, vocab))
    programs = dict(engine._programs)
    monkeypatch.setattr(engine, "_programs", {key: (lambda *a, p=p: events.append("forward") or p(*a)) for key, p in programs.items()})
    prompts = [[{"role": "user", "content": f"{p} Answer in JSON."}] for p in PROMPTS[:4]]
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=24, logprobs=2, presence_penalty=0.5 * (i % 3), structured_outputs={"json": s} if i % 2 else None)
              for i, s in enumerate(SCHEMAS[:4])]
    runs = {}
    for overlap in (True, False):
        monkeypatch.setattr(engine, "overlap_masks", overlap)
        events.clear()
        runs[overlap] = [(o.token_ids, o.logprobs) for o in smollm2_llm.chat(prompts, params)]
        pairs = list(zip(events[::2], events[1::2]))
        assert pairs and set(pairs) == {("forward", "masks") if overlap else ("masks", "forward")}, events[:6]
    assert runs[True] == runs[False]
    assert any(ids for ids, _ in runs[True]) and all(len(lp) == len(ids) for ids, lp in runs[True])


def _deep_schema_line(depth: int) -> dict:
    """A 100 KB schema: `$defs` d0 .. d{depth}, each an object whose one property refers to the next."""
    defs = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["next"]} for i in range(depth)}
    return {"structured_outputs": {"json": {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{depth}": {"type": "integer"}}}}}


def _deep_lark_line(depth: int) -> dict:
    return {"guided_grammar": "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(depth)), f'r{depth}: "a"'])}


def _run_job(model, input_path, output_path, cache, *extra) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(model), "--input", str(input_path), "--output", str(output_path),
               "--compile-cache", cache, "--max-context", "128", "--max-num-seqs", "2", "--page-size", "16", "--temperature", "0", "--no-progress", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_job_with_grammars_that_crash_the_checker_writes_their_error_records_and_resumes(tmp_path, tiny_chat_model, compile_cache):
    """A 1,000-deep $defs chain and a 4,000-rule Lark chain used to SIGSEGV the job (and every --resume)
    with 0 records: now exit 0, one record per line, theirs errors naming the crash, the others' as alone."""
    lines = {
        "deep_schema": _deep_schema_line(1000),
        "good": {"guided_regex": "[0-9]{3}"},
        "deep_lark": _deep_lark_line(4000),
        "no_token": {"allowed_token_ids": [2], "min_tokens": 3},
        "empty": {"guided_json": {"$ref": "#"}},
    }
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    input_path.write_text("".join(json.dumps({"id": key, "prompt": "Hi", "max_tokens": 8, **fields}) + "\n" for key, fields in lines.items()))
    first = _run_job(tiny_chat_model, input_path, output_path, compile_cache)
    assert first.returncode == 0, first.stderr[-3000:]
    written = records(output_path)
    assert sorted(r["id"] for r in written) == sorted(lines)  # one record per line, in the order they finished
    _check_records({r["id"]: r for r in written})
    output_path.write_bytes(b"".join(line + b"\n" for line in output_path.read_bytes().split(b"\n")[:1]))  # only the first record
    resumed = _run_job(tiny_chat_model, input_path, output_path, compile_cache, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = {r["id"]: r for r in by_key(output_path).values()}
    assert sorted(again) == sorted(lines)
    _check_records(again)
    assert again["good"]["text"] == {r["id"]: r for r in written}["good"]["text"]


def _check_records(by_id: dict) -> None:
    errors = {key: record["error"] for key, record in by_id.items() if record["status"] == "error"}
    assert set(errors) == {"deep_schema", "deep_lark", "no_token", "empty"}, by_id
    for key in ("deep_schema", "deep_lark"):
        assert "structured_outputs" in errors[key] and "the grammar checker crashed (signal 11, SIGSEGV)" in errors[key], errors[key]
    assert "its language is empty" in errors["empty"], errors["empty"]
    assert "no token may follow the 0 tokens so far: allowed_token_ids + min_tokens" in errors["no_token"], errors["no_token"]
    assert re.fullmatch("[0-9]{3}", by_id["good"]["text"]), by_id["good"]
