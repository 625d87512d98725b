"""`jaxinfer generate --ray`: JSONL jobs on a real local Ray cluster (Ray Data actors, each an LLM).

The jobs run on conftest's tiny_chat_model (a random 2-layer Llama with SmolLM2's real tokenizer), as
in test_batch_cli: what is checked is the distributed bookkeeping. Each job is a CLI subprocess that
starts its own local cluster of 2 CPUs, so this pytest process never imports ray.

- a 40-line job through two actors, one of whose processes is killed mid-job (SIGKILL), equals the same
  job run locally, record for record (bad lines included as error records, logprobs within 1e-4), every
  key exactly once;
- killing the driver mid-job and rerunning with --resume ends the same way.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from job_records import by_key, records

pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'jaxinfer[ray]' (make test installs it)")

ENGINE_FLAGS = ["--max-context", "128", "--max-num-seqs", "2", "--page-size", "16", "--temperature", "0", "--no-progress"]
RAY_FLAGS = ["--ray", "--ray-actors", "2", "--ray-batch-size", "4"]
NUM_GOOD = 36
BAD_LINES = {  # line number -> the reason its error record must name
    4: "malformed JSON", 11: "missing or invalid 'id'", 19: "did you mean 'max_tokens'", 27: "temperature must be a finite number",
}


def features(i: int) -> dict:
    """Some lines use the request surface too: n samples with logprobs, a grammar, penalties."""
    return ({"n": 2, "temperature": 0.8, "seed": i, "logprobs": 2} if i % 5 == 1 else {"structured_outputs": {"regex": "[0-9]{1,4}"}} if i % 7 == 2
            else {"presence_penalty": 1.0, "logit_bias": {"100": 3.0}} if i % 9 == 3 else {})


def write_input(path: Path) -> Path:
    """40 lines: 36 good chat requests (some with features()), 4 bad lines at BAD_LINES."""
    good = iter(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"Question {i}: name a number."}], "max_tokens": 24} | features(i))
                for i in range(NUM_GOOD))
    bad = {4: '{"id": "broken", "prompt": "unterminated', 11: json.dumps({"prompt": "no id"}), 19: json.dumps({"id": "typo", "prompt": "hi", "max_token": 3}),
           27: '{"id": "nan", "prompt": "hi", "temperature": NaN}'}
    lines = [bad[n] if n in bad else next(good) for n in range(1, NUM_GOOD + len(bad) + 1)]
    path.write_text("\n".join(lines) + "\n")
    return path


def cli(input_path, output_path, cache, model, *extra) -> list[str]:
    return [
        sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(model), "--input", str(input_path), "--output", str(output_path),
        "--compile-cache", cache, *ENGINE_FLAGS, *extra,
    ]


def run(cmd) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _env() -> dict:
    return os.environ | {"RAY_USAGE_STATS_ENABLED": "0", "JAX_PLATFORMS": "cpu"}


def comparable(record: dict) -> tuple:
    samples = [s["token_ids"] for s in record.get("samples", [])]
    return record["status"], record["id"], record["line"], record.get("token_ids"), record.get("text"), record.get("error"), samples


def actor_pids() -> set[int]:
    """Processes of live jaxinfer LLM actors (Ray names an actor's process after its class)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"ray::" in title and b"LLMActor" in title:
                pids.add(int(entry.name))
    return pids


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def job(tmp_path_factory, compile_cache, tiny_chat_model):
    """The 40-line input and its local run (the reference every Ray run must equal, in comparable(): status, key,
    line, tokens, text, error, samples' tokens): its bad lines are error records naming their reason, its grammar
    lines match the regex."""
    tmp = tmp_path_factory.mktemp("ray")
    input_path = write_input(tmp / "in.jsonl")
    run(cli(input_path, tmp / "local.jsonl", compile_cache, tiny_chat_model))
    local = by_key(tmp / "local.jsonl")
    assert len(local) == 40 and sum(r["status"] == "ok" for r in local.values()) == NUM_GOOD
    for number, reason in BAD_LINES.items():
        (record,) = [r for r in local.values() if r["line"] == number]
        assert record["status"] == "error" and reason in record["error"], record
    assert all(re.fullmatch(r"[0-9]{1,4}", r["text"]) for r in local.values() if r["status"] == "ok" and features(int(r["id"][1:])).get("structured_outputs"))
    return tmp, input_path, local, compile_cache, tiny_chat_model


@pytest.mark.slow
def test_two_actors_one_killed_and_restarted_run_the_job_like_the_local_one_every_line_once(job):
    """One Ray job checks both: the records of two actors equal the local run's (error records, samples and
    logprobs included), and that still holds when one actor's process is killed mid-job and restarted (the
    lines it held are retried, none written twice). Before the kill (at 8 or more of 40 records) both actors
    run undisturbed."""
    tmp, input_path, local, cache, model = job
    output = tmp / "killed_actor.jsonl"
    driver = subprocess.Popen(cli(input_path, output, cache, model, *RAY_FLAGS), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        wait_for(lambda: output.exists() and len(records(output)) >= 8, 600, "the first batches' records")
        victims = actor_pids()
        assert len(victims) == 2, victims
        written_at_kill = len(records(output))
        victim = min(victims)
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = driver.communicate(timeout=900)
    finally:
        driver.kill()
    assert driver.returncode == 0, stderr[-3000:]
    assert written_at_kill < 40, "the job ended before the kill: nothing was retried"
    assert "40 requests (36 ok, 4 errors)" in stdout
    got = by_key(output)
    assert {k: comparable(r) for k, r in got.items()} == {k: comparable(r) for k, r in local.items()}
    sampled = [r for r in got.values() if "samples" in r]
    assert sampled and all(len(r["samples"]) == 2 and len(r["samples"][1]["logprobs"]) == len(r["samples"][1]["token_ids"]) for r in sampled)
    for key, record in got.items():
        for ours, theirs in zip(record.get("logprobs", []), local[key].get("logprobs", [])):
            assert abs(ours["logprob"] - theirs["logprob"]) <= 1e-4


@pytest.mark.slow
def test_a_killed_driver_resumes_on_ray_without_loss_or_duplicates(job):
    tmp, input_path, local, cache, model = job
    output = tmp / "killed_driver.jsonl"
    driver = subprocess.Popen(cli(input_path, output, cache, model, *RAY_FLAGS), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    try:
        wait_for(lambda: output.exists() and len(records(output)) >= 4, 600, "the first batch's records")
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        driver.kill()
    partial = len(records(output))
    assert partial < 40, "the job ended before the kill"
    wait_for(lambda: not actor_pids(), 120, "the killed driver's actors to exit")
    stale = output.with_name(output.name + ".steps.jsonl")
    stale.write_text('{"kind": "header"}\n')  # an earlier run's step log, as a local run leaves one
    result = run(cli(input_path, output, cache, model, *RAY_FLAGS, "--resume"))
    assert not stale.exists()  # a Ray run writes none, and leaves none to pass for its own (whatif)
    counts = re.search(r"requests ok / error / skipped\s+(\d+) / (\d+) / (\d+)", result.stderr)
    assert counts and int(counts[3]) == partial, result.stderr[-2000:]  # the resumed run did only the rest
    got = by_key(output)
    assert {k: comparable(r) for k, r in got.items()} == {k: comparable(r) for k, r in local.items()}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ray-actors", "2"], "--ray-actors works with --ray"),
        (["--ray", "--ray-actors", "0"], "--ray-actors must be >= 1"),
        (["--ray", "--ray-gpus-per-actor", "-1"], "--ray-gpus-per-actor must be a finite number"),
        (["--ray-max-retries", "1"], "--ray-max-retries works with --ray"),
        (["--ray", "--ray-max-retries", "-1"], "--ray-max-retries must be in [0, 100]"),
    ],
)
def test_ray_flags_are_checked_before_anything_loads(tmp_path, flags, message):
    input_path = write_input(tmp_path / "in.jsonl")
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli", "generate", "--input", str(input_path), "--output", str(tmp_path / "out.jsonl"), *flags],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_ray_with_one_prompt_is_refused(tmp_path):
    result = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "generate", "--prompt", "hi", "--ray"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--ray runs an --input FILE job" in result.stderr, result.stderr


_CRASHING_JOB = """
import os, signal, sys
from pathlib import Path
from jaxinfer.batch import ray as ray_jobs
from jaxinfer.batch.job import BatchJob
from jaxinfer.config import EngineConfig
from jaxinfer.scheduling.request import SamplingParams

class CrashingActor(ray_jobs.LLMActor):
    def __call__(self, batch):
        if any("CRASH" in text for text in batch["line"]):
            os.kill(os.getpid(), signal.SIGSEGV)  # what a native crash does to the actor's process
        return super().__call__(batch)

inp, out, model, cache = sys.argv[1:5]
# 2 programs (the full tables hold 13): every start of the actor, the first and each restart, warms them up
engine = EngineConfig(max_context=128, max_num_seqs=2, page_size=16, compilation_cache_dir=cache,
                      prefill_chunk_buckets=(32,), decode_batch_buckets=(2,), decode_page_buckets=(8,))
with BatchJob(Path(inp), Path(out), SamplingParams(temperature=0, max_tokens=4)) as job:
    summary = ray_jobs.run_job(job, ray_jobs.RayOptions(num_actors=1, batch_size=4, max_retries=1), model=model, engine_config=engine, progress=False,
                               actor=CrashingActor)
print("counts", summary.num_ok, summary.num_errors)
"""


@pytest.mark.slow
def test_a_line_that_kills_its_actor_is_retried_a_bounded_number_of_times_then_is_its_error_record(tmp_path, compile_cache, tiny_chat_model):
    """Its batch of 4 dies twice (max_retries=1: every death restarts the actor), then each of its lines runs alone: the
    crashing one dies twice more and gets its error record; the other lines' records are written, each once."""
    lines = [json.dumps({"id": f"q{i}", "prompt": f"Question {i}"}) for i in range(5)]
    lines.insert(2, json.dumps({"id": "crash", "prompt": "CRASH"}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    result = subprocess.run(
        [sys.executable, "-c", _CRASHING_JOB, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), str(tiny_chat_model), compile_cache],
        capture_output=True, text=True, timeout=600, env=_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "counts 5 1" in result.stdout, result.stdout
    got = by_key(tmp_path / "out.jsonl")
    assert sorted(got) == sorted(['id:"crash"'] + [f'id:"q{i}"' for i in range(5)])  # every line once
    crash = got['id:"crash"']
    assert crash["status"] == "error" and "actor died running it (2 times" in crash["error"] and crash["line"] == 3  # max_retries=1: 2 tries alone
    assert all(got[f'id:"q{i}"']["status"] == "ok" for i in range(5))


def test_a_deeply_nested_line_the_parser_took_travels_to_an_actor_whole():
    """A line's unknown field nested 600 deep parses (the line runs without it); sending it to an actor copied its
    JSON recursively in Python (dataclasses.asdict) and stopped the driver."""
    from jaxinfer.batch.input import iter_lines, read_lines
    from jaxinfer.batch.ray import line_from_json, line_to_json

    raw = ('{"id": 1, "prompt": "hi", "meta": ' + "[" * 600 + "]" * 600 + "}\n").encode()
    (line,) = read_lines(iter_lines([raw]))
    assert line.problem is None and line.ignored == ("meta",)
    back = line_from_json(line_to_json(line))
    assert (back.number, back.key, back.obj["prompt"], back.problem) == (line.number, line.key, "hi", None)
