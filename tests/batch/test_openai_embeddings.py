"""Embedding lines in batch files: OpenAI `/v1/embeddings` lines (text or token ids, float or base64, pooling
and normalize) and jaxinfer lines with `embed`, mixed with generation lines, give the vectors LLM.embed gives,
in OpenAI's embeddings object (validated with the openai package's types); bad embedding lines are that
line's error naming the field."""

import base64
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse

from conftest import TINY_CHAT_ENGINE
from jaxinfer import SamplingParams
from jaxinfer.api import LLM
from jaxinfer.batch.job import BatchJob
from job_records import by_key

URL = "/v1/embeddings"


@pytest.fixture(scope="module")
def llm(tiny_chat_model, compile_cache):
    return LLM(tiny_chat_model, compilation_cache_dir=compile_cache, **TINY_CHAT_ENGINE)


def line(custom_id: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL, "body": {"model": "tiny"} | body})


def test_openai_embedding_lines_give_llm_embed_vectors_beside_chat_lines(llm, tmp_path):
    texts = ["The cat sat.", "A much longer sentence about the history of a small fishing village.", "Hi", "Numbers 1 2 3", "Fifth one"]
    lines = [line(f"e{i}", input=text) for i, text in enumerate(texts)]
    lines += [line("ids", input=[5, 6, 7, 8]), line("mean", input=texts[0], pooling="mean", normalize=False), line("b64", input=[texts[1]], encoding_format="base64")]
    lines += [json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}})]
    lines += [line("dims", input="x", dimensions=8), line("pool", input="x", pooling="cls"), line("temp", input="x", temperature=0.5),
              line("long", input="word " * 300), line("two", input=["a", "b"])]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    with BatchJob(tmp_path / "in.jsonl", tmp_path / "out.jsonl", SamplingParams(temperature=0)) as job:
        summary = job.run(llm, progress=False)
    out = {k.split(":", 1)[1].strip('"'): r for k, r in by_key(tmp_path / "out.jsonl").items()}
    assert summary.request_counts() == {"completed": 9, "failed": 5, "total": 14}
    want = llm.embed(texts)
    for i, text in enumerate(texts):
        body = CreateEmbeddingResponse.model_validate(out[f"e{i}"]["response"]["body"])
        np.testing.assert_allclose(body.data[0].embedding, want[i].embedding, atol=1e-6)
        assert body.usage.prompt_tokens == want[i].num_prompt_tokens == len(llm.encode(text))
    np.testing.assert_allclose(out["ids"]["response"]["body"]["data"][0]["embedding"], llm.embed([[5, 6, 7, 8]])[0].embedding, atol=1e-6)
    np.testing.assert_allclose(out["mean"]["response"]["body"]["data"][0]["embedding"], llm.embed([texts[0]], pooling="mean", normalize=False)[0].embedding, atol=1e-6)
    decoded = np.frombuffer(base64.b64decode(out["b64"]["response"]["body"]["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, want[1].embedding, atol=1e-6)
    assert out["chat"]["response"]["body"]["object"] == "chat.completion"
    for name, param in (("dims", "dimensions"), ("pool", "pooling"), ("temp", "temperature"), ("long", "input"), ("two", "input")):
        assert out[name]["response"]["status_code"] == 400 and out[name]["error"]["param"] == param, out[name]["error"]


def test_jaxinfer_embed_lines_carry_the_embedding_and_bad_ones_name_the_field(llm, tmp_path):
    lines = [{"id": "a", "prompt": "The cat sat.", "embed": True}, {"id": "b", "prompt": "The cat sat.", "embed": {"pooling": "mean"}},
             {"id": "c", "prompt": "Say hi", "max_tokens": 2}, {"id": "d", "prompt": "x", "embed": {"pool": "mean"}},
             {"id": "e", "messages": [{"role": "user", "content": "x"}], "embed": True}]
    (tmp_path / "in.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    with BatchJob(tmp_path / "in.jsonl", tmp_path / "out.jsonl", SamplingParams(temperature=0)) as job:
        job.run(llm, progress=False)
    out = {r["id"]: r for r in by_key(tmp_path / "out.jsonl").values()}
    np.testing.assert_allclose(out["a"]["embedding"], llm.embed(["The cat sat."])[0].embedding, atol=1e-6)
    np.testing.assert_allclose(out["b"]["embedding"], llm.embed(["The cat sat."], pooling="mean")[0].embedding, atol=1e-6)
    assert out["a"]["num_prompt_tokens"] == len(llm.encode("The cat sat.")) and "text" in out["c"]
    assert out["d"]["status"] == "error" and "embed must be" in out["d"]["error"]
    assert out["e"]["status"] == "error" and "not 'messages'" in out["e"]["error"]


def test_records_carry_the_weight_version_that_made_them(llm, tmp_path):
    """After LLM.update_params (the same weights again: version + 1), embedding, generation and OpenAI lines all say so."""
    before = llm.weight_version
    llm.update_params(llm.params)
    files = {"jaxinfer": [json.dumps({"id": "a", "prompt": "The cat sat.", "embed": True}), json.dumps({"id": "c", "prompt": "Say hi", "max_tokens": 2})],
             "openai": [line("o", input="x")]}  # a file holds one format
    out = {}
    for name, lines in files.items():
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        with BatchJob(tmp_path / f"{name}.jsonl", tmp_path / f"{name}.out.jsonl", SamplingParams(temperature=0)) as job:
            job.run(llm, progress=False)
        out |= by_key(tmp_path / f"{name}.out.jsonl")
    assert len(out) == 3 and {record["weight_version"] for record in out.values()} == {before + 1}


@pytest.mark.slow
def test_the_cli_locally_and_on_ray_writes_the_same_embedding_records(tiny_chat_model, compile_cache, tmp_path):
    """`jaxinfer generate` on a file of embedding and chat lines, locally and with --ray (two actors): the same
    records, vectors within 1e-6 (skipped without the ray extra)."""
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'jaxinfer[ray]'")
    lines = [line(f"e{i}", input=f"Sentence number {i} about boats.", pooling=("last", "mean")[i % 2]) for i in range(6)]
    lines += [json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}),
              line("bad", input="x", dimensions=3)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0", "JAX_PLATFORMS": "cpu"}
    base = [sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(tiny_chat_model), "--input", str(tmp_path / "in.jsonl"),
            "--compile-cache", compile_cache, "--max-context", "128", "--max-num-seqs", "2", "--page-size", "16", "--temperature", "0", "--no-progress"]
    for name, extra in (("local", []), ("ray", ["--ray", "--ray-actors", "2", "--ray-batch-size", "4"])):
        done = subprocess.run([*base, "--output", str(tmp_path / f"{name}.jsonl"), *extra], capture_output=True, text=True, timeout=900, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    local, ray = by_key(tmp_path / "local.jsonl"), by_key(tmp_path / "ray.jsonl")
    assert local.keys() == ray.keys() and len(local) == 8
    for key, record in local.items():
        assert record["response"]["status_code"] == ray[key]["response"]["status_code"], key
        if "data" in record["response"]["body"]:
            np.testing.assert_allclose(ray[key]["response"]["body"]["data"][0]["embedding"], record["response"]["body"]["data"][0]["embedding"], atol=1e-6)
    assert sum("data" in r["response"]["body"] for r in local.values()) == 6
