"""`echo` with `logprobs` and `max_tokens: 0` on /v1/completions (what lm-eval's OpenAI-completions model
sends to score a prompt), in OpenAI's shape: the prompt's text before the completion's, its tokens before
the completion's in the logprobs lists, the first one null; the values equal LLM.generate's prompt logprobs.
A jaxinfer line scores with `max_tokens: 0`, `prompt_logprobs` and `logprob_start`."""

import json

import pytest
from openai.types import CompletionUsage

from conftest import TINY_CHAT_ENGINE
from jaxinfer.api import LLM
from jaxinfer.batch.job import BatchJob
from jaxinfer.scheduling.request import SamplingParams
from job_records import records

COMPLETIONS = "/v1/completions"
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def llm(tiny_chat_model, compile_cache):
    return LLM(tiny_chat_model, compilation_cache_dir=compile_cache, **TINY_CHAT_ENGINE)


def completion(custom_id: str, prompt, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": {"model": "tiny", "prompt": prompt, "temperature": 0} | body}


def run_lines(llm, tmp_path, lines: list[dict]) -> dict:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with BatchJob(inp, out, SamplingParams(temperature=0, max_tokens=3)) as job:
        job.run(llm, progress=False)
    return {r.get("custom_id", r.get("id")): r for r in records(out)}


def test_echo_with_logprobs_and_max_tokens_zero_scores_the_prompt_in_openai_shape(llm, tmp_path):
    ids = llm.encode(PROMPT)
    reference = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    by_id = run_lines(llm, tmp_path, [
        completion("score", PROMPT, echo=True, logprobs=2, max_tokens=0),
        completion("both", PROMPT, echo=True, logprobs=1, max_tokens=2),
        completion("text", ids, echo=True, max_tokens=2),
    ])
    body = by_id["score"]["response"]["body"]
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    usage = CompletionUsage.model_validate(body["usage"])  # the SDK's own type: prompt_tokens_details (cached tokens) is OpenAI's field
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(ids), 0, len(ids)) and 0 <= usage.prompt_tokens_details.cached_tokens < len(ids)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [llm.token_text(t) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx([lp for lp, _ in reference[1:]], abs=1e-6)
    assert [list(top) for top in logprobs["top_logprobs"][1:]] == [[llm.token_text(t) for t in top] for _, top in reference[1:]]
    assert logprobs["text_offset"][-1] == len(PROMPT) - len(logprobs["tokens"][-1])
    both = by_id["both"]["response"]["body"]["choices"][0]
    generated = both["text"][len(PROMPT):]
    assert both["text"].startswith(PROMPT) and generated
    assert len(both["logprobs"]["tokens"]) == len(ids) + 2 and "".join(both["logprobs"]["tokens"][len(ids):]) == generated
    assert all(lp <= 0 for lp in both["logprobs"]["token_logprobs"][1:])
    text = by_id["text"]["response"]["body"]["choices"][0]  # a prompt of token ids echoes their text; no logprobs asked
    assert text["text"] == PROMPT + generated and text["logprobs"] is None


def test_echo_under_truncate_gives_the_text_that_was_scored(llm, tmp_path):
    """A prompt over the context cut by --truncate left: the echo is its kept end, token for token the logprobs' tokens."""
    long_prompt = " ".join([PROMPT] * 40)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(completion("cut", long_prompt, echo=True, logprobs=0, max_tokens=0)) + "\n")
    with BatchJob(inp, out, SamplingParams(temperature=0, max_tokens=3), truncate="left") as job:
        job.run(llm, progress=False)
    choice = records(out)[0]["response"]["body"]["choices"][0]
    assert len(llm.encode(long_prompt)) > 128 and len(choice["logprobs"]["tokens"]) == 128  # max_tokens 0: the whole context
    assert choice["text"] == "".join(choice["logprobs"]["tokens"]) and long_prompt.endswith(choice["text"]) and len(choice["text"]) < len(long_prompt)


def test_echo_must_be_a_boolean_max_tokens_zero_needs_logprobs_and_chat_has_no_echo(llm, tmp_path):
    chat = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "echo": True}}
    by_id = run_lines(llm, tmp_path, [completion("bad", PROMPT, echo="yes"), completion("zero", PROMPT, echo=True, max_tokens=0), chat])
    for key, param, phrase in [("bad", "echo", "echo must be true or false"), ("zero", "max_tokens", "max_tokens must be >= 1"), ("chat", "echo", "echo is not supported")]:
        error = by_id[key]["response"]["body"]["error"]
        assert by_id[key]["response"]["status_code"] == 400 and error["param"] == param and phrase in error["message"], error


def test_a_jaxinfer_line_scores_its_prompt_from_logprob_start(llm, tmp_path):
    ids = llm.encode(PROMPT)
    by_id = run_lines(llm, tmp_path, [{"id": "s", "prompt": PROMPT, "max_tokens": 0, "prompt_logprobs": 0, "logprob_start": 4}])
    record = by_id["s"]
    assert record["finish_reason"] == "length" and record["num_generated_tokens"] == 0
    assert record["prompt_logprobs"][:4] == [None] * 4
    assert [e["token_id"] for e in record["prompt_logprobs"][4:]] == ids[4:]


@pytest.mark.slow
def test_echo_lines_through_ray_equal_the_local_run(tiny_chat_model, compile_cache, tmp_path):
    """The same OpenAI file with echo lines, run by `jaxinfer generate` locally and with --ray (2 actors)."""
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'jaxinfer[ray]'")
    import os
    import subprocess
    import sys

    lines = [completion(f"e{i}", f"{PROMPT} Line {i}.", echo=True, logprobs=1, max_tokens=i % 3) for i in range(4)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    flags = ["--max-context", "128", "--max-num-seqs", "2", "--page-size", "16", "--temperature", "0", "--no-progress", "--compile-cache", compile_cache]
    bodies = {}
    for name, extra in (("local", []), ("ray", ["--ray", "--ray-actors", "2", "--ray-batch-size", "2"])):
        out = tmp_path / f"{name}.jsonl"
        cmd = [sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(tiny_chat_model), "--input", str(inp), "--output", str(out), *flags, *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=os.environ | {"RAY_USAGE_STATS_ENABLED": "0", "JAX_PLATFORMS": "cpu"})
        assert done.returncode == 0, done.stderr[-3000:]
        bodies[name] = {r["custom_id"]: r["response"]["body"]["choices"] for r in records(out)}
    assert bodies["ray"] == bodies["local"] and len(bodies["local"]) == 4
    assert all(choices[0]["text"].startswith(PROMPT) and choices[0]["logprobs"]["token_logprobs"][0] is None for choices in bodies["local"].values())
