"""Batch jobs in process on a tiny real-vocabulary model: every reported poison line becomes its own
error record, resume is exactly-once, and a fuzzed job killed at random points and resumed ends equal
to an uninterrupted run."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_CHAT_ENGINE
from jaxinfer.api import LLM
import subprocess

from jaxinfer.batch import job as batch_module
from jaxinfer.batch import output_file as batch_output
from jaxinfer.batch.input import EncodingCheck, InputFileError, iter_lines, read_lines
from jaxinfer.batch.job import BatchJob, JobLines, LineRunner, ResumeError, check_paths
from jaxinfer.scheduling.request import SamplingParams
from job_records import by_key, records

DEFAULTS = SamplingParams(temperature=0, max_tokens=6)


def read_input(data: bytes) -> list:
    """Every non-blank line of `data`, keyed and parsed, as the job reads them."""
    return list(read_lines(iter_lines([data])))


def refused_whole(data: bytes) -> bool:
    """Whether the job refuses the whole input before any line (input.EncodingCheck: UTF-16 or -32, CR-only line
    ends, a byte-order mark in the middle)."""
    check = EncodingCheck()
    try:
        check.feed(data)
        check.finish()
    except InputFileError:
        return True
    return False


def read_done(path: Path):
    """The keys a resume finds done in an output, after its repair (a torn last record cut off)."""
    scan = batch_output.scan_output(path, iter_lines)
    batch_output.repair_output(path, scan)
    return scan.keys


@pytest.fixture(scope="module")
def llm(tiny_chat_model, compile_cache):
    return LLM(tiny_chat_model, compilation_cache_dir=compile_cache, **TINY_CHAT_ENGINE)


class Killed(Exception):
    """Stands in for SIGKILL: records are fsynced one by one, so the file is what a kill leaves."""


class KilledJob(BatchJob):
    def __init__(self, *args, kill_after: int, torn: bytes = b"", **kwargs):
        super().__init__(*args, **kwargs)
        self.kill_after, self.torn, self.num_written = kill_after, torn, 0

    def _write(self, record: dict) -> None:
        if self.num_written == self.kill_after:
            self._file.write(self.torn)  # a record cut off mid-write
            raise Killed
        super()._write(record)
        self.num_written += 1


def write(path: Path, lines: list) -> Path:
    """Lines are dicts (dumped as JSON), str (raw text) or bytes (raw)."""
    data = b"".join((json.dumps(x).encode() if isinstance(x, dict) else x.encode("utf-8", "surrogatepass") if isinstance(x, str) else x) + b"\n" for x in lines)
    path.write_bytes(data)
    return path


def run_job(llm, input_path, output_path, *, resume=False, kill_after=None, **kwargs):
    if kill_after is None:
        job = BatchJob(input_path, output_path, DEFAULTS, resume=resume, **kwargs)
    else:
        job = KilledJob(input_path, output_path, DEFAULTS, resume=resume, kill_after=kill_after, **kwargs)
    try:
        return job.run(llm, progress=False)
    except Killed:
        return None


def comparable(record: dict) -> tuple:
    return record["status"], record.get("token_ids"), record.get("text"), record.get("error"), record["id"]


def good(i, **fields) -> dict:
    return {"id": f"q{i}", "prompt": f"Question {i}: what comes next?"} | fields


# ------------------------------------------------------------------ each reported case, as a test


POISON = {
    "stop_not_string": good(1, stop=[1]),
    "top_k_overflow": good(2, top_k=2147483648),
    "lone_surrogate": '{"id": "q3", "prompt": "\\ud800"}',
    "temperature_nan": '{"id": "q4", "prompt": "hi", "temperature": NaN}',
    "temperature_inf": '{"id": "q5", "prompt": "hi", "temperature": Infinity}',
    "empty_stop": good(6, stop=[""]),
    "stop_token_string": good(7, stop_token_ids=["5"]),
    "stop_token_float": good(8, stop_token_ids=[1.5]),
    "stop_token_range": good(9, stop_token_ids=[10**6]),
    "typo_field": good(10, max_token=5),
    "deadline_nan": '{"id": "q11", "prompt": "hi", "deadline_s": NaN}',
    "missing_prompt": {"id": "q12"},
    "empty_prompt": {"id": "q13", "prompt": ""},
    "prompt_and_messages": {"id": "q14", "prompt": "a", "messages": [{"role": "user", "content": "b"}]},
    "bad_utf8": b'{"id": "q15", "prompt": "caf\xe9"}',
    "too_long": good(16, prompt="word " * 400),
}
EXPECTED_REASON = {
    "stop_not_string": "stop must hold non-empty strings", "top_k_overflow": "top_k must be in", "lone_surrogate": "lone surrogate",
    "temperature_nan": "temperature must be a finite number", "temperature_inf": "temperature must be a finite number",
    "empty_stop": "stop must hold non-empty strings", "stop_token_string": "stop_token_ids must be an integer",
    "stop_token_float": "stop_token_ids must be an integer", "stop_token_range": "token ids must be integers in [0, 49152)",
    "typo_field": "did you mean 'max_tokens'", "deadline_nan": "deadline_s must be a finite number",
    "missing_prompt": "exactly one of 'prompt' or 'messages'", "empty_prompt": "'prompt' must be a non-empty string",
    "prompt_and_messages": "exactly one of 'prompt' or 'messages'", "bad_utf8": "invalid UTF-8 (byte 0xe9", "too_long": "--truncate",
}


def test_each_poison_line_is_its_own_error_record_with_its_id_and_the_rest_runs(llm, tmp_path):
    lines = [good(0)] + list(POISON.values()) + [good(99)]
    out = tmp_path / "out.jsonl"
    summary = run_job(llm, write(tmp_path / "in.jsonl", lines), out)
    got = {r["line"]: r for r in records(out)}
    assert len(got) == len(lines) and summary.num_ok == 2 and summary.num_errors == len(POISON)
    assert got[1]["status"] == got[len(lines)]["status"] == "ok"
    for line_number, name in enumerate(POISON, start=2):
        record = got[line_number]
        assert record["status"] == "error" and EXPECTED_REASON[name] in record["error"], (name, record)
        assert record["error"].startswith(f"line {line_number}: ")
        assert record["id"] == f"q{line_number - 1}", name  # a valid id survives into the error record


def test_line_separators_inside_a_line_do_not_split_it_and_resume_reads_them(llm, tmp_path):
    odd = "\u2028\u2029\u0085"
    lines = [good(0, prompt=f"one{odd}two"), {"id": f"id{odd}", "prompt": "x"}, good(2)]
    inp, out = write(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    run_job(llm, inp, out, kill_after=2)
    run_job(llm, inp, out, resume=True)
    assert [r["status"] for r in sorted(records(out), key=lambda r: r["line"])] == ["ok", "ok", "ok"]
    assert {r["id"] for r in records(out)} == {"q0", f"id{odd}", "q2"}


def test_bom_on_the_first_line_is_ignored(llm, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(good(0)).encode() + b"\n")
    run_job(llm, path, tmp_path / "out.jsonl")
    assert records(tmp_path / "out.jsonl")[0]["status"] == "ok"


def test_duplicate_id_killed_before_the_first_finishes_still_runs_the_first(llm, tmp_path):
    inp, out = write(tmp_path / "in.jsonl", [good(0), good(1), good(0, prompt="again")]), tmp_path / "out.jsonl"
    run_job(llm, inp, out, kill_after=1)  # only the duplicate's error record (written at read time) survives
    assert [r["key"] for r in records(out)] == ['id:"q0"#2']
    run_job(llm, inp, out, resume=True)
    final = by_key(out)
    assert final['id:"q0"']["status"] == "ok" and "duplicate id 'q0' (first on line 1)" in final['id:"q0"#2']["error"]
    assert len(final) == 3


def test_ids_1_and_string_1_are_different_lines(llm, tmp_path):
    inp, out = write(tmp_path / "in.jsonl", [{"id": 1, "prompt": "a"}, {"id": "1", "prompt": "b"}]), tmp_path / "out.jsonl"
    run_job(llm, inp, out, kill_after=1)
    run_job(llm, inp, out, resume=True)
    assert sorted((r["key"], r["status"]) for r in records(out)) == [('id:"1"', "ok"), ("id:1", "ok")]


def test_a_line_inserted_above_an_id_less_line_does_not_hide_a_new_line(llm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write(inp, ['{"prompt": "no id"}', good(1)])
    run_job(llm, inp, out)
    write(inp, [good(5), '{"prompt": "no id"}', good(1)])  # the user inserts a new line at the top
    summary = run_job(llm, inp, out, resume=True)
    assert summary.num_skipped == 2 and summary.num_ok == 1
    assert by_key(out)['id:"q5"']["status"] == "ok"


def test_resume_reproduces_unseeded_sampled_outputs(llm, tmp_path):
    sampled = [good(i, temperature=1.0, max_tokens=8) for i in range(6)]
    inp = write(tmp_path / "in.jsonl", sampled)
    run_job(llm, inp, tmp_path / "full.jsonl")
    run_job(llm, inp, tmp_path / "part.jsonl", kill_after=3)
    run_job(llm, inp, tmp_path / "part.jsonl", resume=True)
    full, part = by_key(tmp_path / "full.jsonl"), by_key(tmp_path / "part.jsonl")
    assert {k: r["token_ids"] for k, r in full.items()} == {k: r["token_ids"] for k, r in part.items()}
    assert len({tuple(r["token_ids"]) for r in full.values()}) > 1, "unseeded requests should differ from each other"


def test_torn_last_record_is_dropped_and_redone(llm, tmp_path):
    inp, out = write(tmp_path / "in.jsonl", [good(i) for i in range(4)]), tmp_path / "out.jsonl"
    run_job(llm, inp, out, kill_after=2, torn=b'{"id": "q2", "li')
    assert len(read_done(out)) == 2 and out.read_bytes().endswith(b"}\n")
    run_job(llm, inp, out, resume=True)
    assert sorted(by_key(out)) == sorted(f'id:"q{i}"' for i in range(4))


def test_a_line_whose_later_sample_failed_in_a_step_is_an_error_record_naming_it():
    from jaxinfer.batch.records import record_of
    from jaxinfer.outputs import RequestMetrics, RequestOutput

    (line,) = read_lines(iter_lines([b'{"id": "a", "prompt": "hi", "n": 2}\n']))
    ok = RequestOutput(0, "x", [5], "length", 3, 1, 0.1, 0.2, num_samples=2, metrics=RequestMetrics(0.0, 0.1, 0.1, 0.0, 2, 0))
    failed = RequestOutput(0, "", [], "error", 3, 0, math.nan, 0.2, error="the step failed: OSError: gone", sample_index=1, num_samples=2)
    record = record_of(line, dataclasses.replace(ok, samples=[ok, failed]))
    assert record["status"] == "error" and record["error"] == "line 1: sample 1 of 2 failed: the step failed: OSError: gone"
    assert record["finish_reason"] == "error" and record["num_prompt_tokens"] == 3  # as whatif reads a line that failed in a step
    late = dataclasses.replace(failed, finish_reason="timeout", error=None)
    record = record_of(line, dataclasses.replace(ok, samples=[ok, late]))
    assert record["error"] == "line 1: sample 1 of 2 timed out: its deadline passed before it started" and record["finish_reason"] == "timeout"
    assert record_of(line, dataclasses.replace(ok, samples=[ok, ok]))["status"] == "ok"


def test_the_resume_scan_counts_the_records_it_keeps_a_key_written_twice_twice(tmp_path):
    """whatif skips a resumed run's records_before records of the output: records, not keys, and not a torn tail."""
    rec = lambda key: json.dumps({"id": key, "key": key, "status": "ok"})  # noqa: E731
    path = tmp_path / "out.jsonl"
    path.write_text(rec("a") + "\n\n" + rec("b") + "\n" + rec("a") + "\n" + '{"id": "c", "ke')  # a blank line; a torn last record
    scan = batch_output.scan_output(path, iter_lines)
    assert scan.num_records == 3 and len(scan.keys) == 2
    path.write_text(rec("a") + "\n" + rec("a") + "\n" + rec("b"))  # whole, its newline missing
    assert batch_output.scan_output(path, iter_lines).num_records == 3


def test_resume_over_foreign_or_damaged_output_is_one_clear_error(tmp_path):
    inp = write(tmp_path / "in.jsonl", [good(0)])
    write(tmp_path / "a.jsonl", [{"status": "ok"}])
    with pytest.raises(ResumeError, match="line 1 has no 'key'"):
        BatchJob(inp, tmp_path / "a.jsonl", DEFAULTS, resume=True)
    write(tmp_path / "b.jsonl", ["not json", {"key": "x"}])
    with pytest.raises(ResumeError, match="line 1 is not a JSON record"):
        BatchJob(inp, tmp_path / "b.jsonl", DEFAULTS, resume=True)


def test_output_equal_to_input_or_in_a_missing_directory_is_refused_before_anything_runs(tmp_path):
    inp = write(tmp_path / "in.jsonl", [good(0)])
    before = inp.read_bytes()
    for resume, overwrite in ((False, True), (True, False)):
        with pytest.raises(ValueError, match="is the input file"):
            check_paths(inp, inp, resume=resume, overwrite=overwrite)
    with pytest.raises(ValueError, match="output directory does not exist"):
        check_paths(inp, tmp_path / "nope" / "out.jsonl", resume=False, overwrite=False)
    assert inp.read_bytes() == before


def test_keys_number_repeats_and_hash_id_less_lines():
    lines = read_input(b'{"id": 1, "prompt": "a"}\n\n{"id": 1, "prompt": "b"}\n{"x": 1}\n{"x": 1}\n  \n')
    assert [line.key for line in lines][:2] == ["id:1", "id:1#2"]
    assert lines[2].key.startswith("sha256:") and lines[3].key == lines[2].key + "#2"
    assert [line.number for line in lines] == [1, 3, 4, 5]


# ------------------------------------------------------------------ fuzz: random files, random kills

_GOOD = st.builds(
    lambda i, t, n, seed: json.dumps({"id": f"g{i}", "prompt": f"Tell me about {i}", "temperature": t, "max_tokens": n} | ({"seed": seed} if seed is not None else {})),
    st.integers(0, 30), st.sampled_from([0, 0.8]), st.integers(1, 6), st.none() | st.integers(0, 100),
)
_ODD_TEXT = st.text(alphabet=st.sampled_from(list("ab \u2028\u2029\u0085\u00e9\U0001f600\"\\{}")), min_size=1, max_size=12)
_LINES = st.one_of(
    _GOOD,
    st.builds(lambda s: json.dumps({"id": s, "prompt": s}), _ODD_TEXT),  # odd unicode, in ids too
    st.builds(lambda s: json.dumps({"prompt": s}), _ODD_TEXT),  # id-less
    st.sampled_from([v if isinstance(v, (str, bytes)) else json.dumps(v) for v in POISON.values()]),
    st.binary(max_size=12).filter(lambda b: b"\n" not in b and not b.startswith(b"\xef\xbb\xbf{")),  # random bytes (a BOM line mid-file is refused whole)
    st.just(""),  # blank
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(_LINES, min_size=1, max_size=10), kills=st.lists(st.integers(0, 8), max_size=3), data=st.data())
def test_fuzzed_job_killed_and_resumed_equals_an_uninterrupted_run(llm, tmp_path_factory, lines, kills, data):
    tmp = tmp_path_factory.mktemp("fuzz")
    raw = [line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line for line in lines]
    inp = write(tmp / "in.jsonl", raw)
    if refused_whole(inp.read_bytes()):  # random bytes first that read as a UTF-16 or -32 byte-order mark, say
        with pytest.raises(InputFileError):
            run_job(llm, inp, tmp / "full.jsonl")
        return
    run_job(llm, inp, tmp / "full.jsonl")
    for kill_after in kills:
        torn = data.draw(st.sampled_from([b"", b'{"id": "g1", "st']))
        run_job(llm, inp, tmp / "part.jsonl", resume=(tmp / "part.jsonl").exists(), kill_after=kill_after, torn=torn)
    run_job(llm, inp, tmp / "part.jsonl", resume=(tmp / "part.jsonl").exists())
    expected_keys = {line.key for line in read_input(inp.read_bytes())}
    full, part = by_key(tmp / "full.jsonl"), by_key(tmp / "part.jsonl")
    assert set(full) == set(part) == expected_keys  # one record per non-blank line, none twice
    assert {k: comparable(r) for k, r in part.items()} == {k: comparable(r) for k, r in full.items()}
    for line in read_input(inp.read_bytes()):
        assert part[line.key]["id"] == line.request_id and part[line.key]["line"] == line.number


# ------------------------------------------------------------------ streaming intake (issue 26)


class CountingRunner(LineRunner):
    """The real runner; it counts the lines it has prepared (tokenized) so far."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prepared = 0

    def _prepare(self, llm, line, *, index):
        prompt = super()._prepare(llm, line, index=index)
        self.prepared += 1
        return prompt


class WatchedJob(BatchJob):
    """The real job, noting at each record it writes how many lines were prepared but not yet written."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runner = CountingRunner(self.runner.defaults, self.runner.truncate, self.runner.max_inflight)
        self.ahead, self.num_ok_written = [], 0

    def _write(self, record: dict) -> None:
        super()._write(record)
        self.num_ok_written += record["status"] == "ok"
        self.ahead.append(self.runner.prepared - self.num_ok_written)


def test_lines_are_prepared_lazily_at_most_max_inflight_ahead_of_the_records(llm, tmp_path):
    lines = [good(i) for i in range(40)]
    lines[10:10] = [{"id": "bad", "prompt": "x", "temperature": -1}]  # an error record on the way counts for nothing
    inp = write(tmp_path / "in.jsonl", lines)
    job = WatchedJob(inp, tmp_path / "out.jsonl", DEFAULTS, max_inflight=3)
    assert isinstance(job.todo, JobLines) and len(job.todo) == 41
    summary = job.run(llm, progress=False)
    assert summary.num_ok == 40 and summary.num_errors == 1 and len(records(tmp_path / "out.jsonl")) == 41
    assert max(job.ahead) <= 3 and job.runner.prepared == 40, job.ahead


class RecordedBar:
    """Stands in for tqdm: records each bar's total and count."""

    bars: list = []

    def __init__(self, *, total=None, disable=False, **_):
        self.total, self.disable, self.n = total, disable, 0
        RecordedBar.bars.append(self)

    def update(self, n=1):
        self.n += n

    def close(self):
        pass


def test_the_progress_bar_total_is_the_lines_to_run_and_the_input_stays_lazy(llm, tmp_path, monkeypatch):
    from jaxinfer import api

    monkeypatch.setattr(api, "tqdm", RecordedBar)
    monkeypatch.setattr(RecordedBar, "bars", [])
    inflight, original = [], api.LLM._stream
    monkeypatch.setattr(api.LLM, "_stream", lambda self, prompts, **kw: inflight.append(kw["max_inflight"]) or original(self, prompts, **kw))
    lines = [good(i) for i in range(12)]
    inp = write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    run_job(llm, inp, out, kill_after=5)
    write(inp, lines + [{"id": "bad", "prompt": "x", "temperature": -1}])
    job = BatchJob(inp, out, DEFAULTS, resume=True)
    assert len(job.todo) == 8 and job.num_runnable == 7  # the bad line's error record needs no step
    summary = job.run(llm, progress=True)
    assert summary.num_ok == 7 and summary.num_errors == 1
    (bar,) = RecordedBar.bars[-1:]
    assert not bar.disable and bar.total == 7 and bar.n == 7
    assert inflight[-1] == 4 * llm.engine_config.max_num_seqs  # the default for a lazy input, unchanged by the total


def test_a_long_run_of_bad_lines_drains_in_bounded_batches_and_loses_none(llm, tmp_path, monkeypatch):
    monkeypatch.setattr(batch_module, "_MAX_PENDING_ERRORS", 3)  # error records held back before the stream drains
    lines = [good(0)] + [{"id": f"bad{i}", "prompt": "x", "top_p": 0} for i in range(11)] + [good(i) for i in range(1, 6)]
    inp = write(tmp_path / "in.jsonl", lines)
    summary = run_job(llm, inp, tmp_path / "out.jsonl")
    out = by_key(tmp_path / "out.jsonl")
    assert summary.num_ok == 6 and summary.num_errors == 11 and len(out) == 17
    assert all("top_p must be" in r["error"] for r in out.values() if r["status"] == "error")


def test_the_resume_scan_reads_the_output_in_blocks_across_a_torn_tail(llm, tmp_path, monkeypatch):
    monkeypatch.setattr(batch_output, "_SCAN_BLOCK", 7)  # every record spans several blocks
    inp = write(tmp_path / "in.jsonl", [good(i) for i in range(5)])
    out = tmp_path / "out.jsonl"
    run_job(llm, inp, out, kill_after=3, torn=b'{"id": "q9", "li')
    assert len(read_done(out)) == 3 and out.read_bytes().endswith(b"}\n")
    run_job(llm, inp, out, resume=True)
    assert sorted(by_key(out)) == sorted(line.key for line in read_input(inp.read_bytes()))


def test_an_input_read_from_a_pipe_is_spooled_so_the_job_reads_it_after_its_scan(llm, tmp_path):
    inp = write(tmp_path / "in.jsonl", [good(i) for i in range(6)])
    with open(inp, "rb") as source:
        reader = subprocess.Popen(["cat"], stdin=source, stdout=subprocess.PIPE)
        summary = run_job(llm, Path(f"/dev/fd/{reader.stdout.fileno()}"), tmp_path / "out.jsonl")
    reader.wait()
    assert summary.num_ok == 6 and len(records(tmp_path / "out.jsonl")) == 6
