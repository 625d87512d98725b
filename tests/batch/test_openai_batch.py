"""OpenAI Batch files in and out (as `vllm run-batch` reads and writes them), on the tiny real-vocabulary model:
the requests are built with the `openai` package's request types and every output line is validated with its
response models; a bad line is its own error record with the status an OpenAI client expects; custom_id is
the resume key; fields vLLM or OpenAI define that jaxinfer lacks are line errors naming the field."""

import json
from pathlib import Path

import pytest
from openai.types import BatchError, BatchRequestCounts, Completion
from openai.types import completion_create_params
from openai.types.chat import ChatCompletion, ChatCompletionSystemMessageParam, ChatCompletionUserMessageParam
from openai.types.chat import completion_create_params as chat_create_params

from conftest import TINY_CHAT_ENGINE
from jaxinfer.batch import openai as openai_batch
from jaxinfer.api import LLM
from jaxinfer.batch.input import InputFileError, iter_lines, read_lines
from jaxinfer.batch.job import BatchJob
from jaxinfer.batch.records import token_bytes_of
from jaxinfer.scheduling.request import SAMPLING_FIELDS, SamplingParams
from jaxinfer.validation import UNSUPPORTED_REQUEST_FIELDS
from job_records import by_key, records

DEFAULTS = SamplingParams(temperature=0, max_tokens=3)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def llm(tiny_chat_model, compile_cache):
    return LLM(tiny_chat_model, compilation_cache_dir=compile_cache, **TINY_CHAT_ENGINE)


def chat_request(custom_id: str, text: str, **body) -> dict:
    params = chat_create_params.CompletionCreateParamsNonStreaming(
        model="tiny", messages=[ChatCompletionSystemMessageParam(role="system", content="Be brief."), ChatCompletionUserMessageParam(role="user", content=text)],
        **({"max_completion_tokens": 3, "temperature": 0} | body),
    )
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": dict(params)}


def completion_request(custom_id: str, text: str, **body) -> dict:
    params = completion_create_params.CompletionCreateParamsNonStreaming(model="tiny", prompt=text, **({"max_tokens": 2, "temperature": 0, "seed": 7} | body))
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": dict(params)}


# Twenty bad lines: (the line, the status code its record must carry, a phrase of its message, the param named).
BAD = [
    (json.dumps({"custom_id": "b01", "method": "POST", "url": "/v1/moderations", "body": {"input": "x"}}), 404, "url '/v1/moderations' is not supported", "url"),
    (json.dumps({"custom_id": "b02", "method": "GET", "url": CHAT, "body": {}}), 405, "method 'GET'", "method"),
    (json.dumps(chat_request("b03", "hi", n=2)), 400, "n (2) with greedy sampling", "n"),
    (json.dumps(chat_request("b04", "hi", response_format={"type": "json_xml"})), 400, "response_format must be", "response_format"),
    (json.dumps(chat_request("b05", "hi", tools=[{"type": "function", "function": {"name": "f"}}])), 400, "tools is not supported", "tools"),
    (json.dumps(chat_request("b06", "hi", user="someone")), 400, "user is not supported", "user"),
    (json.dumps(completion_request("b07", "hi", best_of=3)), 400, "best_of is not supported", "best_of"),
    (json.dumps(chat_request("b08", "hi") | {"body": chat_request("b08", "hi")["body"] | {"stream": True}}), 400, "stream is not supported", "stream"),
    (json.dumps(chat_request("b09", "hi", temperature="hot")), 400, "temperature must be a number", "temperature"),
    (json.dumps(chat_request("b10", "hi") | {"body": chat_request("b10", "hi")["body"] | {"max_token": 5}}), 400, "did you mean 'max_tokens'", "max_token"),
    (json.dumps(completion_request("b11", "hi") | {"body": completion_request("b11", "hi")["body"] | {"max_tokens": 0}}), 400, "max_tokens must be", "max_tokens"),
    (json.dumps(chat_request("b12", "hi", top_p=2.0)), 400, "top_p must be a finite number", "top_p"),
    (json.dumps(completion_request("b13", "word " * 400)), 400, "--truncate", "prompt"),
    (json.dumps(completion_request("b14", ["one", "two"])), 400, "a list of several prompts", "prompt"),
    (json.dumps({"custom_id": "b15", "method": "POST", "url": CHAT, "body": {"model": "tiny", "prompt": "x"}}), 400, "needs 'messages'", "messages"),
    (json.dumps({"custom_id": "b16", "method": "POST", "url": CHAT, "body": "not an object"}), 400, "'body' must be a JSON object", "body"),
    (json.dumps({"method": "POST", "url": CHAT, "body": {"messages": [{"role": "user", "content": "x"}]}}), 400, "'custom_id'", "custom_id"),
    ('{"custom_id": "b18", "method": "POST", "url": "/v1/chat/completions", "body": {', 400, "malformed JSON", None),
    (json.dumps(chat_request("g000", "a repeat of the first custom_id")), 400, "duplicate custom_id 'g000'", "custom_id"),
    (json.dumps(chat_request("b20", "hi") | {"body": chat_request("b20", "hi")["body"] | {"guided_decoding_backend": "xgrammar"}}), 400, "guided_decoding_backend is not supported", "guided_decoding_backend"),
]


def write_file(path: Path, num_good: int = 180) -> tuple[Path, dict]:
    """`num_good` requests (chat and completions, alternating) with the twenty bad lines spread among them."""
    good = [chat_request(f"g{i:03d}", f"Question {i}?") if i % 2 == 0 else completion_request(f"g{i:03d}", f"Once upon a time {i}") for i in range(num_good)]
    lines = [json.dumps(r) for r in good]
    for j, (line, *_rest) in enumerate(BAD):
        lines.insert(1 + j * (len(lines) // len(BAD)), line)
    path.write_text("\n".join(lines) + "\n")
    return path, {r["custom_id"]: r["url"] for r in good}


def check_output_line(record: dict) -> None:
    """Every output line: OpenAI's batch output shape, its body validated with the openai package's models."""
    assert set(record) >= {"id", "custom_id", "response", "error"} and record["id"].startswith("batch_req_")
    response = record["response"]
    assert isinstance(response["request_id"], str) and isinstance(response["status_code"], int)
    if response["status_code"] == 200:
        assert record["error"] is None
        body = response["body"]
        model = ChatCompletion if body["object"] == "chat.completion" else Completion
        parsed = model.model_validate(body)
        assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
        assert parsed.choices[0].finish_reason in ("stop", "length") and parsed.choices[0].index == 0
    else:
        error = BatchError.model_validate(record["error"])
        assert error.message and error.line >= 1
        assert set(response["body"]["error"]) == {"message", "type", "param", "code"}


def test_a_vllm_style_file_of_200_lines_with_20_bad_ones_gives_200_valid_output_lines(llm, tmp_path):
    inp, good = write_file(tmp_path / "batch.jsonl")
    out = tmp_path / "out.jsonl"
    with BatchJob(inp, out, DEFAULTS) as job:
        assert job.format == "openai" and len(job.todo) == 200
        summary = job.run(llm, progress=False)
    lines = records(out)
    assert len(lines) == 200 and len({r["key"] for r in lines}) == 200
    for record in lines:
        check_output_line(record)
    assert BatchRequestCounts.model_validate(summary.request_counts()) == BatchRequestCounts(completed=180, failed=20, total=200)
    by_custom_id = {r["custom_id"]: r for r in lines if r["key"].startswith("custom_id:") and "#" not in r["key"]}
    for custom_id, url in good.items():
        body = by_custom_id[custom_id]["response"]["body"]
        assert body["object"] == ("chat.completion" if url == CHAT else "text_completion") and body["model"] == "tiny"
        assert body["usage"]["completion_tokens"] == (3 if url == CHAT else 2)  # max_completion_tokens / max_tokens were applied
    errors = [r for r in lines if r["response"]["status_code"] != 200]
    assert len(errors) == 20
    for (line, status, phrase, param), record in zip(BAD, sorted(errors, key=lambda r: r["error"]["line"])):
        assert record["response"]["status_code"] == status, (phrase, record)
        assert phrase in record["error"]["message"], (phrase, record["error"]["message"])
        assert record["error"]["param"] == param == record["response"]["body"]["error"]["param"], (phrase, record["error"])


def test_custom_id_is_the_resume_key_and_a_killed_job_resumes_to_one_line_each(llm, tmp_path):
    inp, _ = write_file(tmp_path / "batch.jsonl", num_good=30)
    full, partial = tmp_path / "full.jsonl", tmp_path / "partial.jsonl"
    with BatchJob(inp, full, DEFAULTS) as job:
        job.run(llm, progress=False)
    with BatchJob(inp, partial, DEFAULTS) as job:
        job.write(r for _, r in zip(range(17), job.runner.records(llm, job.todo)))  # stopped after 17 lines
    assert len(records(partial)) == 17
    with BatchJob(inp, partial, DEFAULTS, resume=True) as job:
        assert job.summary.num_skipped == 17 and len(job.todo) == 33
        job.run(llm, progress=False)
    final, expected = by_key(partial), by_key(full)
    assert sorted(final) == sorted(expected)  # none lost, none twice
    text = lambda r: (r["response"]["status_code"], json.dumps(r["response"]["body"].get("choices")))  # noqa: E731
    assert {k: text(r) for k, r in final.items()} == {k: text(r) for k, r in expected.items()}
    assert 'custom_id:"g003"' in final


def test_a_resume_in_the_other_format_is_refused(llm, tmp_path):
    inp, _ = write_file(tmp_path / "batch.jsonl", num_good=2)
    out = tmp_path / "out.jsonl"
    with BatchJob(inp, out, DEFAULTS) as job:
        job.write(r for _, r in zip(range(1), job.runner.records(llm, job.todo)))
    with pytest.raises(ValueError, match="format"):
        BatchJob(inp, out, DEFAULTS, resume=True, fmt="jaxinfer")


def test_format_is_detected_from_the_first_non_empty_line_or_forced(llm, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n\n" + json.dumps(completion_request("c1", "Hello")) + "\n")
    with BatchJob(inp, tmp_path / "a.jsonl", DEFAULTS) as job:
        assert job.format == "openai"
    with BatchJob(inp, tmp_path / "b.jsonl", DEFAULTS, fmt="jaxinfer") as job:  # forced: every line is a bad jaxinfer line
        job.run(llm, progress=False)
    (record,) = records(tmp_path / "b.jsonl")
    assert record["status"] == "error" and "'id'" in record["error"]
    with pytest.raises(ValueError, match="format must be one of"):
        BatchJob(inp, tmp_path / "c.jsonl", DEFAULTS, fmt="csv")


def test_unknown_fields_are_warned_about_before_running_and_strict_fields_makes_them_errors(llm, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    lines = [chat_request("u1", "Hi") | {"body": chat_request("u1", "Hi")["body"] | {"my_tag": 1}}, completion_request("u2", "Hello"), {"id": "j1", "prompt": "x"}]
    inp.write_text("\n".join(json.dumps(line) for line in lines[:2]) + "\n")
    with BatchJob(inp, tmp_path / "warn.jsonl", DEFAULTS) as job:
        assert "unknown fields" in capsys.readouterr().err and job.summary.ignored_fields == {"my_tag": 1}  # before anything runs
        job.run(llm, progress=False)
    assert [r["response"]["status_code"] for r in sorted(records(tmp_path / "warn.jsonl"), key=lambda r: r["custom_id"])] == [200, 200]
    with BatchJob(inp, tmp_path / "strict.jsonl", DEFAULTS, strict_fields=True) as job:
        job.run(llm, progress=False)
    by_id = {r["custom_id"]: r for r in records(tmp_path / "strict.jsonl")}
    assert by_id["u1"]["response"]["status_code"] == 400 and "'my_tag' is not a known field" in by_id["u1"]["error"]["message"]
    assert by_id["u2"]["response"]["status_code"] == 200
    (tmp_path / "j.jsonl").write_text(json.dumps({"id": "j1", "prompt": "x", "colour": "red"}) + "\n")  # jaxinfer's lines: the same rule
    with BatchJob(tmp_path / "j.jsonl", tmp_path / "j_out.jsonl", DEFAULTS, strict_fields=True) as job:
        job.run(llm, progress=False)
    assert "'colour' is not a known field" in records(tmp_path / "j_out.jsonl")[0]["error"]


def test_known_fields_jaxinfer_lacks_are_line_errors_in_both_formats_and_supported_ones_never_are():
    lines = list(read_lines(iter_lines([b'{"id": "a", "prompt": "x", "best_of": 3}\n{"id": "b", "prompt": "x", "best_of": 1}\n{"id": "c", "prompt": "x", "tools": []}\n'])))
    assert "best_of is not supported" in lines[0].problem and lines[1].problem is None and "tools is not supported" in lines[2].problem
    assert not set(UNSUPPORTED_REQUEST_FIELDS) & SAMPLING_FIELDS  # no field is both supported and refused...
    for name in SAMPLING_FIELDS:  # ...and the check consults SamplingParams at runtime, so none could be
        (line,) = read_lines(iter_lines([json.dumps({"id": "s", "prompt": "x", name: "?"}).encode()]))
        assert line.problem is None or "is not supported by jaxinfer" not in line.problem, (name, line.problem)


def test_status_codes_follow_what_went_wrong():
    record = openai_batch.error_record('custom_id:"x"', "x", 3, "timed out: its deadline passed before it started", 408)
    assert record["response"]["status_code"] == 408 and record["response"]["body"]["error"]["type"] == "timeout"
    assert BatchError.model_validate(record["error"]).line == 3


def test_n_logprobs_and_response_format_come_back_in_openai_shapes(llm, tmp_path):
    """n choices in order, logprobs in each endpoint's shape (validated by the openai package's models,
    and equal to the jaxinfer record's figures), and a json_schema response_format that the text follows."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    lines = [
        chat_request("n2", "Hi", n=2, temperature=1.0, seed=5, logprobs=True, top_logprobs=2),
        completion_request("lp", "Once upon", logprobs=2),
        chat_request("js", "Give JSON", response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}, max_completion_tokens=12),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with BatchJob(inp, out, DEFAULTS) as job:
        job.run(llm, progress=False)
    by_id = {r["custom_id"]: r for r in records(out)}
    for record in by_id.values():
        check_output_line(record)
    chat = ChatCompletion.model_validate(by_id["n2"]["response"]["body"])
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
    fields = openai_batch.summary_fields(by_id["n2"])  # what a replay (whatif) and the job's summary read: each choice's tokens
    assert [s["num_generated_tokens"] for s in fields["samples"]] == [len(c.logprobs.content) for c in chat.choices]
    del by_id["n2"]["metrics"]["generated_tokens_per_sample"]  # a record written before they were: the usage shared among the choices
    assert [s["num_generated_tokens"] for s in openai_batch.summary_fields(by_id["n2"])["samples"]] == [
        chat.usage.completion_tokens // 2 + chat.usage.completion_tokens % 2, chat.usage.completion_tokens // 2]
    assert "samples" not in openai_batch.summary_fields(by_id["lp"])
    for choice in chat.choices:
        assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in choice.logprobs.content)
        assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    completion = Completion.model_validate(by_id["lp"]["response"]["body"])
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 2 and all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and all(lp <= 0 for lp in logprobs.token_logprobs)
    text = ChatCompletion.model_validate(by_id["js"]["response"]["body"]).choices[0]
    if text.finish_reason == "stop":  # 12 tokens may cut it; what there is must still be a prefix of valid JSON
        assert isinstance(json.loads(text.message.content)["a"], int)
    else:
        assert text.message.content.startswith("{")


def test_a_jaxinfer_record_holds_samples_logprobs_and_the_chat_options(llm, tmp_path):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}, {"role": "assistant", "content": "Blue and"}]
    lines = [
        {"id": "s", "prompt": "Once upon", "n": 3, "temperature": 1.0, "seed": 2, "max_tokens": 3, "logprobs": 1, "prompt_logprobs": 1},
        {"id": "c", "messages": messages, "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 2},
        {"id": "bad", "prompt": "x", "add_generation_prompt": False},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with BatchJob(inp, out, DEFAULTS) as job:
        job.run(llm, progress=False)
    by_id = {r["id"]: r for r in records(out)}
    s = by_id["s"]
    assert len(s["samples"]) == 3 and s["samples"][0]["token_ids"] == s["token_ids"]
    assert all(len(sample["logprobs"]) == 3 and [e["token_id"] for e in sample["logprobs"]] == sample["token_ids"] for sample in s["samples"])
    assert s["prompt_logprobs"][0] is None and len(s["prompt_logprobs"]) == s["num_prompt_tokens"]
    assert all(len(e["top"]) == 1 for e in s["prompt_logprobs"][1:])
    continued = llm.encode_chat(messages, continue_final_message=True, add_generation_prompt=False)
    assert by_id["c"]["status"] == "ok" and by_id["c"]["num_prompt_tokens"] == len(continued)
    assert by_id["bad"]["status"] == "error" and "add_generation_prompt applies to 'messages'" in by_id["bad"]["error"]


def test_a_bad_first_line_of_an_openai_file_is_one_error_record_in_the_files_format(llm, tmp_path):
    lines = [
        '{"custom_id": "torn", "method": "POST", "url": "/v1/chat/co',  # malformed JSON, first
        json.dumps({"method": "POST", "url": CHAT, "body": {"messages": [{"role": "user", "content": "x"}]}}),  # no custom_id
        json.dumps(chat_request("c1", "Hi")),
        json.dumps(completion_request("c2", "Once upon")),
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    with BatchJob(inp, out, DEFAULTS) as job:
        assert job.format == "openai"
        job.run(llm, progress=False)
    written = sorted(records(out), key=lambda r: r.get("error") and r["error"]["line"] or 99)
    assert len(written) == 4
    for record in written:
        check_output_line(record)
    assert [r["response"]["status_code"] for r in written] == [400, 400, 200, 200]
    assert "malformed JSON" in written[0]["error"]["message"] and written[0]["error"]["line"] == 1
    assert written[1]["error"]["param"] == "custom_id" and written[1]["error"]["line"] == 2
    with BatchJob(inp, out, DEFAULTS, resume=True) as job:  # the same format again: nothing is left to do
        assert job.format == "openai" and job.summary.num_skipped == 4 and len(job.todo) == 0


def test_a_file_whose_lines_disagree_on_the_format_is_refused_before_anything_runs(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("not json\n" + json.dumps({"id": "j1", "prompt": "x"}) + "\n" + json.dumps(chat_request("c1", "Hi")) + "\n")
    with pytest.raises(InputFileError, match=r"line 3 is an OpenAI batch request but line 2 is a jaxinfer line"):
        BatchJob(inp, out, DEFAULTS)
    assert not out.exists()
    with BatchJob(inp, out, DEFAULTS, fmt="openai") as job:  # a forced format is not second-guessed: the other lines are errors
        assert job.format == "openai" and len(job.todo) == 3


def test_a_jaxinfer_line_with_a_field_named_url_or_body_is_a_jaxinfer_line(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": "a", "prompt": "Summarize the page.", "url": "https://example.com/a"}, {"id": "b", "prompt": "Summarize it.", "body": "text"},
             {"id": "c", "prompt": "Hi"}]
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with BatchJob(inp, out, DEFAULTS) as job:  # the other fields are unknown to jaxinfer: warned of and ignored
        assert job.format == "jaxinfer" and len(job.todo) == 3 and job.num_runnable == 3


def test_null_fields_mean_the_default_a_seed_is_any_64_bit_integer_and_a_custom_id_must_be_unicode(llm, tmp_path):
    nulls = dict.fromkeys(("temperature", "top_p", "max_tokens", "stop", "n", "logit_bias", "presence_penalty", "frequency_penalty", "seed"))
    lines = [
        chat_request("plain", "Hi"), chat_request("nulls", "Hi") | {"body": chat_request("nulls", "Hi")["body"] | nulls},
        completion_request("big1", "Once upon", temperature=1.0, seed=2**63 - 1, max_tokens=6),
        completion_request("big2", "Once upon", temperature=1.0, seed=2**63 - 1, max_tokens=6),
        completion_request("neg", "Once upon", temperature=1.0, seed=-(2**63), max_tokens=6),
        completion_request("over", "Once upon", seed=2**64),
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    text += '{"custom_id": "\\ud800", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n'
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(text)
    with BatchJob(inp, out, DEFAULTS) as job:
        job.run(llm, progress=False)
    written = records(out)
    by_id = {r["custom_id"]: r for r in written if r["custom_id"] is not None}
    for record in written:
        check_output_line(record)
    plain, nulled = by_id["plain"]["response"]["body"], by_id["nulls"]["response"]["body"]
    assert by_id["nulls"]["response"]["status_code"] == 200 and nulled["choices"] == plain["choices"] and nulled["usage"] == plain["usage"]
    assert by_id["big1"]["response"]["status_code"] == by_id["neg"]["response"]["status_code"] == 200
    assert by_id["big1"]["response"]["body"]["choices"] == by_id["big2"]["response"]["body"]["choices"]  # the seed, not the custom_id, draws
    assert by_id["over"]["response"]["status_code"] == 400 and by_id["over"]["error"]["param"] == "seed"
    (bad,) = [r for r in written if r["custom_id"] is None]
    assert bad["response"]["status_code"] == 400 and bad["error"]["param"] == "custom_id" and "not valid Unicode" in bad["error"]["message"]


def test_logprobs_bytes_hold_each_token_s_own_bytes_so_a_split_character_is_rebuilt(llm, tmp_path):
    emoji = "😀".encode()  # F0 9F 98 80
    pieces = llm.tokenizer.encode("😀", add_bos=False)  # split over several tokens, none a whole character
    assert len(pieces) > 1
    bias = {str(token): 100.0 for token in pieces}  # the model can only say these tokens
    line = chat_request("e", "Hi", logprobs=True, top_logprobs=1, logit_bias=bias, max_completion_tokens=4)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(line) + "\n")
    with BatchJob(inp, out, DEFAULTS) as job:
        job.run(llm, progress=False)
    (record,) = records(out)
    content = ChatCompletion.model_validate(record["response"]["body"]).choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:  # each token is a piece of the emoji: its bytes are a proper slice of the emoji's UTF-8, not U+FFFD's
        assert entry.bytes and len(entry.bytes) < len(emoji) and bytes(entry.bytes) in emoji, entry


def test_the_bytes_of_a_text_s_tokens_join_to_the_text_s_utf8(smollm2_tokenizer):
    text = "Héllo 😀 中文 wörld<|im_start|>\n\ttabs"
    token_bytes = token_bytes_of(smollm2_tokenizer)
    assert b"".join(map(token_bytes, smollm2_tokenizer.encode(text, add_bos=False))) == text.encode("utf-8")
