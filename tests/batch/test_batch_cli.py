"""The JSONL batch CLI: error records for bad lines, resume after SIGKILL without loss or duplicates.

The jobs run on conftest's tiny_chat_model (a random 2-layer Llama with SmolLM2's real tokenizer and chat
template): what is checked here is the CLI's bookkeeping (records, errors, resume, signals), for which a
model's quality does not matter and a real one only costs minutes of decoding.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxinfer.batch.input import LineError, parse
from job_records import records

ENGINE_FLAGS = ["--max-context", "128", "--max-num-seqs", "2", "--page-size", "16", "--temperature", "0", "--no-progress"]
QUESTIONS = [
    "What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello in German.",
    "Describe a cat in one sentence.", "What is the boiling point of water?", "Who painted the Mona Lisa?",
    "Give a synonym for happy.", "What day comes after Monday?", "Name a large ocean.", "What colour is the sky?",
    "How many legs does a spider have?", "Spell the word cat.", "What is 10 minus 3?", "Name a planet.",
    "What do bees make?", "Which season follows winter?", "Translate yes into French.",
]  # 18: the tiny model's job then lasts about a second past the first results, time to interrupt it


def write_input(path) -> dict[str, str]:
    """Eighteen good requests and five bad lines; returns the expected status by id (or line)."""
    # 80 tokens each (a chat prompt is about 40): the tiny model's job lasts long enough to be interrupted
    lines = [json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": q}], "max_tokens": 80}) for i, q in enumerate(QUESTIONS)]
    lines.insert(2, '{"id": "broken", "prompt": "unterminated')
    lines.insert(5, json.dumps({"prompt": "no id here"}))
    lines.insert(7, json.dumps({"id": "toolong", "prompt": "word " * 400}))
    lines.insert(9, json.dumps({"id": "badtemp", "prompt": "hi", "temperature": "hot"}))
    lines.append(json.dumps({"id": "late", "prompt": "hi", "deadline_s": 1e-9}))  # cannot start in 1 ns
    path.write_text("\n".join(lines) + "\n")
    expected = {f"q{i}": "ok" for i in range(len(QUESTIONS))}
    expected.update({"line:3": "error", "line:6": "error", "toolong": "error", "badtemp": "error", "late": "error"})
    return expected  # by id, or by line for the lines without a valid id


def run_cli(input_path, output_path, cache, model, *extra, wait=True):
    cmd = [
        sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(model), "--input", str(input_path), "--output", str(output_path),
        "--compile-cache", cache, *ENGINE_FLAGS, *extra,
    ]
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def key(record: dict) -> str:
    return record["id"] if record["id"] is not None else f"line:{record['line']}"  # unique in this input


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, compile_cache, tiny_chat_model):
    """The uninterrupted job; it also fills the compile cache that the interrupted jobs then read."""
    tmp_path = tmp_path_factory.mktemp("batch")
    input_path = tmp_path / "in.jsonl"
    expected = write_input(input_path)
    result = run_cli(input_path, tmp_path / "full.jsonl", compile_cache, tiny_chat_model)
    return input_path, expected, result, records(tmp_path / "full.jsonl"), tiny_chat_model


@pytest.mark.slow
def test_bad_lines_get_error_records_and_the_rest_completes(full_run):
    _, expected, result, full_records, _ = full_run
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "compiling programs" not in result.stderr and "%|" not in result.stderr  # --no-progress: no bar at all
    assert {key(r): r["status"] for r in full_records} == expected
    assert len(full_records) == len(expected)
    errors = {key(r): r["error"] for r in full_records if r["status"] == "error"}
    assert "malformed JSON" in errors["line:3"] and "line 3" in errors["line:3"]
    assert "'id'" in errors["line:6"]
    assert "context is 128" in errors["toolong"] and "--truncate" in errors["toolong"]
    assert "temperature" in errors["badtemp"]
    assert "timed out" in errors["late"]
    assert re.search(rf"requests ok / error / skipped +{len(QUESTIONS)} / 5 / 0\n", result.stderr), result.stderr[-1500:]
    assert re.search(r"prefix cache hit tokens / queried +\d+ / \d+", result.stderr)


def interrupt_then_resume(full_run, tmp_path, compile_cache, sig):
    """Start the job, send `sig` once two results are written, then --resume; returns (rc, final records)."""
    input_path, expected, _, full_records, model = full_run
    partial_path = tmp_path / "partial.jsonl"
    process = run_cli(input_path, partial_path, compile_cache, model, wait=False)
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if partial_path.exists() and sum(r["status"] == "ok" for r in records(partial_path)) >= 2:
            break
        time.sleep(0.02)
    assert process.poll() is None, "the job finished before it could be interrupted"
    os.kill(process.pid, sig)
    returncode = process.wait(timeout=120)
    assert len(records(partial_path)) < len(expected)
    resumed = run_cli(input_path, partial_path, compile_cache, model, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    final = records(partial_path)
    assert sorted(key(r) for r in final) == sorted(key(r) for r in full_records)  # none missing, none twice
    assert {key(r): r.get("text") for r in final} == {key(r): r.get("text") for r in full_records}
    return returncode


@pytest.mark.slow
def test_resume_after_sigkill_matches_full_run(full_run, tmp_path, compile_cache):
    assert interrupt_then_resume(full_run, tmp_path, compile_cache, signal.SIGKILL) == -signal.SIGKILL


@pytest.mark.slow
def test_sigint_stops_cleanly_and_resume_matches_full_run(full_run, tmp_path, compile_cache):
    assert interrupt_then_resume(full_run, tmp_path, compile_cache, signal.SIGINT) == 130


@pytest.mark.slow
def test_sigterm_stops_cleanly_like_sigint_and_resume_matches_full_run(full_run, tmp_path, compile_cache):
    assert interrupt_then_resume(full_run, tmp_path, compile_cache, signal.SIGTERM) == 130  # 130: the summary was printed


@pytest.mark.slow
@pytest.mark.parametrize("gap_s", [0.0, 0.02, 0.1, 0.4])
def test_a_second_ctrl_c_during_the_clean_stop_exits_130_without_a_traceback(tmp_path, compile_cache, tiny_chat_model, gap_s):
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(input_path)
    cmd = [
        sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(tiny_chat_model), "--input", str(input_path), "--output", str(output_path),
        "--compile-cache", compile_cache, *ENGINE_FLAGS,
    ]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None and not (output_path.exists() and output_path.stat().st_size):
        time.sleep(0.01)
    assert process.poll() is None, "the job finished before it could be interrupted"
    process.send_signal(signal.SIGINT)
    time.sleep(gap_s)  # the second one lands in the clean stop, the summary, or the interpreter's exit
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    assert all(r["status"] in ("ok", "error") for r in records(output_path))  # every record written is whole


def run_fast(*args) -> subprocess.CompletedProcess:
    """A CLI call that must fail before any model loads."""
    return subprocess.run([sys.executable, "-m", "jaxinfer.cli", "generate", *map(str, args)], capture_output=True, text=True, timeout=60)


def one_line_error(result, *needles) -> bool:
    lines = result.stderr.strip().splitlines()
    return result.returncode == 2 and len(lines) == 1 and lines[0].startswith("jaxinfer: error: ") and all(n in lines[0] for n in needles)


def test_cli_refuses_to_overwrite_without_flag(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    (tmp_path / "out.jsonl").write_text("")
    assert one_line_error(run_fast("--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl"), "--resume")


@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--page-size", "0"], ["--page-size must be >= 1"]),
        (["--max-num-seqs", "0"], ["--max-num-seqs must be >= 1"]),
        (["--max-context", "100", "--page-size", "64"], ["--max-context must be a multiple of page_size"]),
        (["--temperature", "nan"], ["--temperature must be a finite number"]),
        (["--top-k", "-1"], ["--top-k must be in"]),
        (["--stop", ""], ["--stop must hold non-empty strings"]),
    ],
)
def test_bad_flags_are_one_line_errors_naming_the_flag_before_loading(tmp_path, flags, needles):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    result = run_fast("--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl", *flags)
    assert one_line_error(result, *needles), result.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_output_equal_to_input_leaves_the_input_untouched(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "hi"}\n{"id": 2, "prompt": "torn')
    before = inp.read_bytes()
    for mode in ("--overwrite", "--resume"):
        assert one_line_error(run_fast("--input", inp, "--output", inp, mode), "is the input file")
    assert inp.read_bytes() == before


def test_output_into_a_missing_directory_fails_before_loading(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    assert one_line_error(run_fast("--input", tmp_path / "in.jsonl", "--output", tmp_path / "no" / "out.jsonl"), "output directory does not exist")


@pytest.mark.parametrize("flag", [["--output", "x.jsonl"], ["--resume"], ["--overwrite"]])
def test_prompt_refuses_batch_only_flags(flag):
    assert one_line_error(run_fast("--prompt", "hi", *flag), flag[0], "--input")


def test_an_input_file_refuses_the_prompt_only_chat_flag(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    assert one_line_error(run_fast("--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl", "--chat"), "--chat works with --prompt", "'messages'")
    assert not (tmp_path / "out.jsonl").exists()


def test_resume_over_an_output_without_keys_is_one_line(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    (tmp_path / "out.jsonl").write_text('{"status": "ok"}\n')
    assert one_line_error(run_fast("--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl", "--resume"), "has no 'key'")


def test_ctrl_c_during_load_exits_130_with_one_line(tmp_path, compile_cache):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxinfer.cli", "generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--compile-cache", compile_cache],
        stderr=subprocess.PIPE, text=True,
    )
    assert process.stderr.readline().startswith("loading")  # printed just before the model loads
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    returncode = process.wait(timeout=120)
    rest = process.stderr.read()
    assert returncode == 130 and "Traceback" not in rest and len(rest.strip().splitlines()) <= 1, rest


@pytest.mark.parametrize(
    "text, reason",
    [
        ("not json", "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt": "x"}', "'id'"),
        ('{"id": 1}', "exactly one of 'prompt' or 'messages'"),
        ('{"id": 1, "prompt": ""}', "non-empty string"),
        ('{"id": true, "prompt": "x"}', "'id'"),
        ('{"id": 1.5, "prompt": "x"}', "'id'"),
        ('{"id": "\\ud800", "prompt": "x"}', "'id'"),
        ("[" * 100000, "malformed JSON"),
    ],
)
def test_parse_line_names_the_problem(text, reason):
    with pytest.raises(LineError, match=reason):
        parse(text)


# ------------------------------------------------------------------ hardening, round two (issue 27)


def copy_output(full_run, tmp_path):
    """A copy of the full run's output and its settings file, to resume without touching the original."""
    source = full_run[0].parent / "full.jsonl"
    target = tmp_path / "out.jsonl"
    for suffix in ("", ".meta.json"):
        (tmp_path / f"out.jsonl{suffix}").write_bytes(source.with_name(source.name + suffix).read_bytes())
    return target


@pytest.mark.slow
def test_resume_with_nothing_left_to_do_loads_no_model(full_run, tmp_path, compile_cache):
    input_path, _, _, full_records, model = full_run
    out = copy_output(full_run, tmp_path)
    start = time.perf_counter()
    result = run_cli(input_path, out, compile_cache, model, "--resume")
    seconds = time.perf_counter() - start
    assert result.returncode == 0 and "nothing to do" in result.stderr and "loading" not in result.stderr, result.stderr[-1500:]
    assert seconds < 20 and records(out) == full_records


@pytest.mark.slow
def test_resume_under_changed_settings_is_refused_listing_them(full_run, tmp_path, compile_cache):
    input_path, _, _, full_records, model = full_run
    out = copy_output(full_run, tmp_path)
    result = run_cli(input_path, out, compile_cache, model, "--resume", "--temperature", "0.7", "--engine-seed", "5")
    assert one_line_error(result, "other settings", "temperature", "engine_seed: 0 -> 5", "--force-settings"), result.stderr[-1500:]
    assert records(out) == full_records
    forced = run_cli(input_path, out, compile_cache, model, "--resume", "--temperature", "0.7", "--force-settings")
    assert forced.returncode == 0 and records(out) == full_records, forced.stderr[-1500:]
    other_limit = run_cli(input_path, out, compile_cache, model, "--resume", "--max-line-bytes", "16")  # longer lines get other keys: records twice
    assert one_line_error(other_limit, "other settings", "max_line_bytes"), other_limit.stderr[-1500:]
    assert records(out) == full_records


@pytest.mark.slow
def test_a_resume_that_loads_no_model_keeps_what_the_engine_resolved_in_the_settings(full_run, tmp_path):
    input_path, _, _, full_records, model = full_run
    out = copy_output(full_run, tmp_path)
    resolved = json.loads(out.with_name("out.jsonl.meta.json").read_text())["settings"]["resolved"]
    more = tmp_path / "more.jsonl"  # one more line, which cannot run: its error record needs no model
    more.write_text(input_path.read_text() + json.dumps({"id": "late", "prompt": "p", "temperature": -1}) + "\n")
    result = run_cli(more, out, "unused", model, "--resume")
    assert result.returncode == 0 and "without loading the model" in result.stderr, result.stderr[-1500:]
    assert len(records(out)) == len(full_records) + 1
    assert json.loads(out.with_name("out.jsonl.meta.json").read_text())["settings"]["resolved"] == resolved  # later resumes still check it


def test_swapped_input_and_output_under_resume_leave_the_prompt_file_untouched(tmp_path):
    prompts, results = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    prompts.write_bytes(b'{"id":"p1","prompt":"Hello"}\n{"id":"p2","prompt":"World"}')
    results.write_text('{"id": "p1", "key": "id:\\"p1\\"", "status": "ok"}\n')
    before = prompts.read_bytes()
    assert one_line_error(run_fast("--input", results, "--output", prompts, "--resume"), "has no 'key'")
    assert prompts.read_bytes() == before


@pytest.mark.slow
def test_a_huge_integer_line_is_an_error_record_and_the_job_exits_0(tmp_path, compile_cache, tiny_chat_model):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id":"ok","prompt":"Hello"}\n{"id":"x","prompt":"x","max_tokens":' + "9" * 5000 + "}\n")
    result = run_cli(inp, tmp_path / "out.jsonl", compile_cache, tiny_chat_model)
    assert result.returncode == 0, result.stderr[-1500:]
    assert {r["id"]: r["status"] for r in records(tmp_path / "out.jsonl")} == {"ok": "ok", "x": "error"}


@pytest.mark.slow
def test_a_second_job_on_one_output_is_refused_at_once_naming_the_first(full_run, tmp_path, compile_cache):
    """The first job is a process holding a BatchJob open (as a running job does, from before its model
    loads until its last record), so the test cannot race a job that finishes first; the soak
    (experiments/soak_batch.py) runs the same probe against a real running CLI job."""
    input_path, _, _, _, model = full_run
    out = tmp_path / "out.jsonl"
    hold = (
        "import sys, time; from pathlib import Path; from jaxinfer.batch.job import BatchJob; from jaxinfer.scheduling.request import SamplingParams; "
        "job = BatchJob(Path(sys.argv[1]), Path(sys.argv[2]), SamplingParams()); print('held', flush=True); time.sleep(120)"
    )
    first = subprocess.Popen([sys.executable, "-c", hold, str(input_path), str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        for mode in ("--resume", "--overwrite"):
            second = run_fast("--model", model, "--input", input_path, "--output", out, mode, "--compile-cache", compile_cache, *ENGINE_FLAGS)
            assert one_line_error(second, "in use by another jaxinfer job", f"pid {first.pid}"), second.stderr
    finally:
        first.kill()
        first.wait()
    assert not out.exists() or out.read_bytes() == b""  # the refused jobs wrote nothing


def test_max_inflight_and_format_flags_are_checked_before_loading(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    assert one_line_error(run_fast("--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl", "--max-inflight", "0"), "--max-inflight must be")
    assert one_line_error(run_fast("--prompt", "hi", "--strict-fields"), "--strict-fields works with --input")
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.slow
def test_an_openai_batch_file_runs_warning_of_unknown_fields_before_the_model_loads(tmp_path, compile_cache, tiny_chat_model):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4, "my_tag": "a"}
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(5)]
    lines.append({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "Once", "max_tokens": 3}})
    lines.append({"custom_id": "n2", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "Once", "n": 2}})
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = run_cli(inp, tmp_path / "out.jsonl", compile_cache, tiny_chat_model, "--max-inflight", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    warning = result.stderr.index("'my_tag' (5 lines)")
    assert warning < result.stderr.index("loading "), result.stderr[:2000]  # counted from the scan, before the model loads
    out = {r["custom_id"]: r for r in records(tmp_path / "out.jsonl")}
    assert len(out) == 7
    for i in range(5):
        assert ChatCompletion.model_validate(out[f"r{i}"]["response"]["body"]).usage.completion_tokens <= 4
    assert Completion.model_validate(out["c"]["response"]["body"]).object == "text_completion"
    assert out["n2"]["response"]["status_code"] == 400 and out["n2"]["error"]["param"] == "n"
    assert re.search(r"requests ok / error / skipped +6 / 1 / 0\n", result.stderr), result.stderr[-1500:]


def test_a_job_whose_every_line_is_an_error_writes_its_records_without_loading_a_model(tmp_path, compile_cache, tiny_chat_model):
    """Bad JSON, a missing prompt and a sampling field out of range: each its error record, and no model
    loads for them (no loading message, no compile). --max-line-bytes makes a long line one more."""
    lines = ['{"id": 1, "prompt": "hi", "temperature": -1}', '{"id": 2}', "not json", json.dumps({"id": 4, "prompt": "x" * 300})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    result = run_cli(tmp_path / "in.jsonl", tmp_path / "out.jsonl", compile_cache, tiny_chat_model, "--max-line-bytes", "256")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "without loading the model" in result.stderr and "loading" not in result.stderr.replace("without loading", "")
    out = records(tmp_path / "out.jsonl")
    assert [r["line"] for r in out] == [1, 2, 3, 4] and all(r["status"] == "error" for r in out)
    assert "temperature" in out[0]["error"] and "256" in out[3]["error"]


def test_a_resume_whose_engine_resolves_otherwise_is_refused(tmp_path, compile_cache, tiny_chat_model):
    """The settings record what "auto" resolved to (dtype, attention, matmul, weight formats), so a resume
    under the same flags but other numerics (here the attention pinned to the jnp reference, where auto chose
    the CPU kernel) is refused, exit 2, the output untouched; the same engine resumes."""
    write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    first = run_cli(tmp_path / "in.jsonl", out, compile_cache, tiny_chat_model, "--attention", "cpu")
    assert first.returncode == 0, first.stderr[-2000:]
    meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())["settings"]
    assert meta["resolved"]["attention_impl"] == "cpu" and meta["resolved"]["dtype"] == "float32"
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]))
    refused = run_cli(tmp_path / "in.jsonl", out, compile_cache, tiny_chat_model, "--attention", "reference", "--resume")
    assert refused.returncode == 2 and "resolved otherwise" in refused.stderr and "attention_impl" in refused.stderr, refused.stderr[-2000:]
    assert out.read_text() == "".join(lines[:2])
    resumed = run_cli(tmp_path / "in.jsonl", out, compile_cache, tiny_chat_model, "--attention", "cpu", "--resume")
    assert resumed.returncode == 0 and len(records(out)) == len(lines), resumed.stderr[-2000:]
