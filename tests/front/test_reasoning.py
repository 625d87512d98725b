"""Reasoning output end to end on a Qwen3-shaped tiny model (q/k norms, model_type qwen3) whose template opens
a `<think>` block: every line of a 20-schema run has reasoning_content and an answer that validates against its
schema (the grammar applies only after the block closes); the thinking_budget closes the block after that many
tokens; enable_thinking=False (chat_template_kwargs) gives no reasoning; jaxinfer and OpenAI batch records
carry the field."""

import json

import jsonschema
import pytest

from jaxinfer import SamplingParams
from jaxinfer.api import LLM
from jaxinfer.batch.job import BatchJob
from job_records import by_key
from test_structured_output import PROMPTS, SCHEMAS
from thinking_model import save_tiny_qwen3_thinker

# 2 programs at warm-up, not the full tables' 29: one prefill chunk and one decode width (every step pads to them)
ENGINE = dict(max_context=512, page_size=16, max_num_seqs=8, max_prefill_tokens=128, prefill_chunk_buckets=(128,), decode_batch_buckets=(8,),
              decode_page_buckets=(32,))
BUDGET = 12
# A random model writes whitespace forever where JSON allows it; llguidance's compact form leaves it none.
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def llm(tmp_path_factory, smollm2_tokenizer, compile_cache):
    folder = save_tiny_qwen3_thinker(tmp_path_factory.mktemp("tiny_qwen3_thinker"), smollm2_tokenizer)
    return LLM(str(folder), compilation_cache_dir=compile_cache, **ENGINE)


def close_id(llm) -> int:
    (token,) = llm.tokenizer.encode("</think>", add_bos=False)
    return token


def test_the_model_is_qwen3_shaped_and_thinks(llm):
    assert llm.model_config.architecture == "qwen3" and llm.model_config.qk_norm
    assert llm.encode_chat([{"role": "user", "content": "hi"}])[-2:] == llm.tokenizer.encode("<think>\n", add_bos=False)


def test_every_answer_of_a_20_schema_run_validates_and_comes_with_its_reasoning(llm):
    schemas, messages = [s | COMPACT for s in SCHEMAS[:20]], [[{"role": "user", "content": f"{p} Think, then answer in JSON."}] for p in PROMPTS[:20]]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=160, thinking_budget=BUDGET, structured_outputs={"json": s}) for i, s in enumerate(schemas)]
    outputs = llm.chat(messages, params)
    for schema, output in zip(schemas, outputs):
        assert output.finish_reason == "stop", (output.finish_reason, output.error, output.reasoning_content, output.text)
        assert output.reasoning_content and "</think>" not in output.reasoning_content, output.reasoning_content
        close = output.token_ids.index(close_id(llm))
        assert close <= BUDGET and llm.tokenizer.decode(output.token_ids[:close]) == output.reasoning_content
        jsonschema.validate(json.loads(output.text), schema)


def test_the_budget_closes_the_block_after_that_many_tokens_and_the_answer_follows(llm):
    (out,) = llm.chat([[{"role": "user", "content": "Think."}]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, thinking_budget=5))
    ids = out.token_ids
    assert ids.index(close_id(llm)) <= 5 and out.reasoning_content == llm.tokenizer.decode(ids[: ids.index(close_id(llm))])
    assert out.text == llm.tokenizer.decode(ids[ids.index(close_id(llm)) + 1 :]) and len(ids) == 20


def test_without_a_budget_or_grammar_the_block_runs_to_max_tokens_as_reasoning(llm):
    (out,) = llm.chat([[{"role": "user", "content": "Think."}]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    if close_id(llm) not in out.token_ids:  # a random model: it almost never writes </think> itself
        assert out.text == "" and out.reasoning_content == llm.tokenizer.decode(out.token_ids)


def test_enable_thinking_false_gives_no_reasoning_and_the_grammar_applies_at_once(llm):
    params = SamplingParams(temperature=0, max_tokens=40, thinking_budget=3, structured_outputs={"json": SCHEMAS[1] | COMPACT})
    (out,) = llm.chat([[{"role": "user", "content": "Pick a colour."}]], params, chat_template_kwargs={"enable_thinking": False})
    assert out.reasoning_content is None and close_id(llm) not in out.token_ids
    jsonschema.validate(json.loads(out.text), SCHEMAS[1])


def test_batch_records_carry_reasoning_content_in_both_formats(llm, tmp_path):
    schema = SCHEMAS[0] | COMPACT
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Describe a person."}], "max_tokens": 120, "temperature": 0,
            "thinking_budget": 6, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    lines = [{"id": "j", "messages": body["messages"], "max_tokens": 120, "temperature": 0, "thinking_budget": 6, "structured_outputs": {"json": schema}},
             ]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (tmp_path / "oai.jsonl").write_text(json.dumps({"custom_id": "o", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    for name in ("in", "oai"):
        with BatchJob(tmp_path / f"{name}.jsonl", tmp_path / f"{name}_out.jsonl", SamplingParams()) as job:
            job.run(llm, progress=False)
    (record,) = by_key(tmp_path / "in_out.jsonl").values()
    assert record["status"] == "ok" and record["reasoning_content"], record
    jsonschema.validate(json.loads(record["text"]), schema)
    (oai,) = by_key(tmp_path / "oai_out.jsonl").values()
    message = oai["response"]["body"]["choices"][0]["message"]
    assert message["reasoning_content"] == record["reasoning_content"] and message["content"] == record["text"], (message, record)
