"""`jaxinfer whatif` end to end: a real job on the default model, then its replay and a prediction under other settings."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from jaxinfer import whatif
from jaxinfer.batch import finished_job as finished
from jaxinfer.scheduling import simulator

QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello in German.", "Describe a cat.", "Who painted the Mona Lisa?"]
ENGINE_FLAGS = ["--max-context", "256", "--max-num-seqs", "4", "--page-size", "16", "--temperature", "0", "--no-progress", "--dtype", "float32"]


def cli(*args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxinfer.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory, compile_cache):
    """Six chat lines of different lengths, run by `jaxinfer generate` on the default model."""
    folder = tmp_path_factory.mktemp("whatif")
    lines = [{"id": f"q{i}", "messages": [{"role": "user", "content": q}], "max_tokens": 8 + 4 * i} for i, q in enumerate(QUESTIONS)]
    (folder / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = cli("generate", "--input", str(folder / "in.jsonl"), "--output", str(folder / "out.jsonl"), "--compile-cache", compile_cache, *ENGINE_FLAGS)
    assert result.returncode == 0, result.stderr[-2000:]
    return folder / "out.jsonl"


def whatif_json(output, *flags) -> dict:
    result = cli("whatif", str(output), "--json", *flags, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


@pytest.mark.slow
def test_whatif_with_no_change_replays_the_job_beside_its_measured_figures(finished_job):
    log = [json.loads(line) for line in finished_job.with_name("out.jsonl.steps.jsonl").read_text().splitlines()]
    summary = next(line for line in log if line["kind"] == "summary")
    records = [json.loads(line) for line in finished_job.read_text().splitlines()]
    report = whatif_json(finished_job)
    for side in ("measured", "predicted"):
        assert set(report[side]) >= {"wall_s", "ttft_p50_s", "ttft_p99_s", "padding"}
    assert report["measured"]["wall_s"] == summary["wall_s"] and report["measured"]["padding"] == summary["padding"]
    ttfts = sorted(r["time_to_first_token_s"] for r in records)
    assert report["measured"]["ttft_p50_s"] == pytest.approx((ttfts[2] + ttfts[3]) / 2)
    assert report["predicted"] == report["replay"] and report["changes"] == {}
    # the replay runs the real scheduler on the job's lengths: the same steps and padding as the job
    assert report["replay"]["num_steps"] == summary["num_steps"]
    assert report["replay"]["padding"] == pytest.approx(summary["padding"], abs=1e-6)
    assert report["replay"]["wall_s"] > 0 and report["replay_error"]["padding"] == pytest.approx(0.0, abs=1e-4)
    assert report["notes"] == []  # nothing but the simulator between the replay and the job


@pytest.mark.slow
def test_whatif_predicts_more_steps_and_time_with_one_sequence_at_a_time(finished_job):
    report = whatif_json(finished_job, "--max-num-seqs", "1", "--buckets", "fitted:2")
    assert report["changes"] == {"max_num_seqs": 1, "buckets": "fitted:2"}
    assert report["predicted"]["num_steps"] > report["replay"]["num_steps"]
    assert report["predicted"]["wall_s"] > report["replay"]["wall_s"]
    assert report["measured"] == whatif_json(finished_job)["measured"]  # the job's own figures do not change
    text = cli("whatif", str(finished_job), "--max-num-seqs", "1", "--buckets", "fitted:2", timeout=120)
    # the text report names the changes as the flags that ask for them (policy, buckets, then sequences)
    assert text.returncode == 0 and "changes: --buckets fitted:2, --max-num-seqs 1\n" in text.stdout, text.stdout


@pytest.mark.slow
def test_whatif_under_a_smaller_prefill_budget_and_a_smaller_pool_predicts_more_steps_and_preemptions(finished_job):
    report = whatif_json(finished_job, "--max-prefill-tokens", "8", "--num-pages", "6")
    assert report["changes"] == {"max_prefill_tokens": 8, "num_pages": 6}
    assert report["replay"]["num_preemptions"] == 0 and report["predicted"]["num_preemptions"] > 0  # 5 free pages for 4 sequences of 3 to 5
    assert report["predicted"]["num_steps"] > report["replay"]["num_steps"]  # the first prompt alone takes 8-token chunks
    assert report["predicted"]["finish_reasons"] == report["replay"]["finish_reasons"]  # preempted requests still finish
    for flags, message in ((["--num-pages", "1"], "--num-pages must be >= 2"), (["--max-prefill-tokens", "0"], "--max-prefill-tokens must be >= 1")):
        result = cli("whatif", str(finished_job), *flags, timeout=120)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.slow
def test_settings_with_several_values_predict_every_combination_and_mark_the_fastest(finished_job):
    report = whatif_json(finished_job, "--max-num-seqs", "1,4", "--num-pages", "6,200")
    grid = report["grid"]
    assert [run["changes"] for run in grid] == [{"max_num_seqs": m, "num_pages": n} for m in (1, 4) for n in (6, 200)]
    fastest = min(grid, key=lambda run: run["predicted"]["wall_s"])
    assert report["predicted"] == fastest["predicted"] and report["changes"] == fastest["changes"] == {"max_num_seqs": 4, "num_pages": 200}
    same = ("wall_s", "ttft_p50_s", "ttft_p99_s", "padding", "num_steps")  # 4 sequences and a pool large enough: the job's own schedule
    assert {k: fastest["predicted"][k] for k in same} == {k: report["replay"][k] for k in same}
    assert grid[0]["predicted"]["num_steps"] > report["replay"]["num_steps"] and grid[2]["predicted"]["num_preemptions"] > 0
    text = cli("whatif", str(finished_job), "--max-num-seqs", "1,4", "--num-pages", "6,200", timeout=120).stdout
    assert "4 settings" in text and "* --max-num-seqs 4, --num-pages 200 " in text and text.count("--max-num-seqs 1, --num-pages") == 2, text
    bad = cli("whatif", str(finished_job), "--policy", "fcfs,magic", timeout=120)
    assert bad.returncode == 2 and "--policy: expects one or more of fcfs" in bad.stderr, bad.stderr
    empty = cli("whatif", str(finished_job), "--policy", "fcfs,,edf", timeout=120)
    assert empty.returncode == 2 and "has an empty value in its comma-separated list: 'fcfs,,edf'" in empty.stderr, empty.stderr


TRACE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.000000,40,12
2023-11-16 18:15:46.050000,300,20
2023-11-16 18:15:46.100000,90,30
2023-11-16 18:15:46.200000,25,0
2023-11-16 18:15:46.400000,256,4
2023-11-16 18:15:46.800000,130,40
2023-11-16 18:15:47.000000,60,16
"""


@pytest.mark.slow
def test_a_trace_is_predicted_on_the_jobs_settings_and_step_costs_beside_other_settings(finished_job, tmp_path):
    (tmp_path / "trace.csv").write_text(TRACE)
    report = whatif_json(finished_job, "--trace", str(tmp_path / "trace.csv"), "--rate", "2", "--max-num-seqs", "1")
    # the job ran with a 256-token context: the prompts of 300 and 256 tokens leave no room for a token
    assert report["trace"] | {"path": None} == {"path": None, "num_requests": 5, "num_left_out": 2, "span_s": 0.5, "rate": 2.0, "max_context": 256}
    assert [run["changes"] for run in report["grid"]] == [{}, {"max_num_seqs": 1}]
    assert report["base"] == report["grid"][0]["predicted"] and report["replay"]["num_requests"] == 6
    job = finished.read_job(finished_job)  # the same prediction from the simulator itself, the arrivals divided by hand
    kept = [(40, 12, 0.0), (90, 30, 0.05), (25, 1, 0.1), (130, 40, 0.4), (60, 16, 0.5)]  # none generated: its prefill's one token
    direct = simulator.simulate(job.engine_config, [simulator.SimRequest(p, o, t) for p, o, t in kept], job.log.costs,
                                num_pages=job.log.header["num_pages"], max_inflight=16).summary()
    assert {k: report["base"][k] for k in ("wall_s", "ttft_p50_s", "num_steps")} == {k: direct[k] for k in ("wall_s", "ttft_p50_s", "num_steps")}
    one = report["grid"][1]["predicted"]
    assert one["num_steps"] > report["base"]["num_steps"] and one["ttft_p99_s"] > report["base"]["ttft_p99_s"]  # one at a time: every wait is queueing
    text = cli("whatif", str(finished_job), "--trace", str(tmp_path / "trace.csv"), timeout=120)
    assert text.returncode == 0 and "5 requests arriving over 1.0 s (rate 1), 2 left out" in text.stdout and "(the job's settings)" in text.stdout, text.stdout
    for flags, message in ((["--rate", "2"], "--rate and --trace-requests work with --trace"), (["--trace", str(tmp_path / "none.csv")], "no such trace file"),
                           (["--trace", str(tmp_path / "trace.csv"), "--rate", "0"], "--rate must be a positive number")):
        bad = cli("whatif", str(finished_job), *flags, timeout=120)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


@pytest.mark.slow
def test_an_slo_adds_the_share_of_requests_within_it_measured_from_the_records_and_predicted(finished_job):
    records = [json.loads(line) for line in finished_job.read_text().splitlines()]
    ttfts = sorted(r["time_to_first_token_s"] for r in records)
    slo_ttft = (ttfts[2] + ttfts[3]) / 2  # about half the lines within it (lines that shared a prefill step may tie)
    report = whatif_json(finished_job, "--slo-ttft", str(slo_ttft), "--slo-tpot", "1000", "--max-num-seqs", "1,4")
    within = sum(r["time_to_first_token_s"] <= slo_ttft and r["metrics"]["time_per_output_token_s"] <= 1000 for r in records)
    assert report["measured"]["slo_attainment"] == round(within / len(records), 4) and 0 < within < len(records)
    assert report["slo"] == {"ttft_s": slo_ttft, "tpot_s": 1000.0} and "slo_attainment" in report["replay_error"]
    for run in report["grid"]:
        assert 0.0 <= run["predicted"]["slo_attainment"] <= 1.0
    assert whatif_json(finished_job, "--slo-tpot", "1000")["replay"]["slo_attainment"] == 1.0  # no TTFT bound, and no step takes 1000 s
    text = cli("whatif", str(finished_job), "--slo-ttft", str(slo_ttft), "--max-num-seqs", "1,4", timeout=120).stdout
    assert "SLO met" in text and "slo_attainment" in text, text
    bad = cli("whatif", str(finished_job), "--slo-ttft", "0", timeout=120)
    assert bad.returncode == 2 and "--slo-ttft must be a positive number of seconds" in bad.stderr, bad.stderr


@pytest.mark.slow
def test_a_new_limit_cuts_the_jobs_own_table_at_it_and_adds_it(finished_job):
    job = finished.read_job(finished_job)
    engine = job.log.header["engine"] | {"prefill_chunk_buckets": [32, 80, 160, 224], "decode_batch_buckets": [1, 2, 4]}  # as a planned job's log holds them
    planned = dataclasses.replace(job, log=dataclasses.replace(job.log, header=job.log.header | {"engine": engine}))
    cfg = whatif.new_config(planned, max_prefill_tokens=100, max_num_seqs=8)
    assert (cfg.prefill_chunk_buckets, cfg.decode_batch_buckets, cfg.max_prefill_tokens, cfg.max_num_seqs) == ((32, 80, 100), (1, 2, 4, 8), 100, 8)
    cfg = whatif.new_config(planned, max_prefill_tokens=400, max_num_seqs=2)
    assert (cfg.prefill_chunk_buckets, cfg.decode_batch_buckets) == ((32, 80, 160, 224, 256), (1, 2))  # a chunk is at most max_context (256)
    assert whatif.new_config(planned, num_pages=40).decode_batch_buckets == (1, 2, 4)  # a change of no limit keeps the tables
    epoch = dataclasses.replace(job, log=dataclasses.replace(job.log, header=job.log.header | {"engine": engine | {"policy": "prefix", "policy_epoch": 8}}))
    assert whatif.new_config(epoch, policy="fcfs").policy_epoch is None and whatif.new_config(epoch, policy="shortest-prompt").policy_epoch == 8


def test_an_output_without_a_step_log_or_missing_is_a_one_line_error(tmp_path):
    output = tmp_path / "out.jsonl"
    output.write_text("")
    result = cli("whatif", str(output), timeout=120)
    assert result.returncode == 2 and "no step log" in result.stderr and "Traceback" not in result.stderr
    missing = cli("whatif", str(tmp_path / "none.jsonl"), timeout=120)
    assert missing.returncode == 2 and "no such output file" in missing.stderr


@pytest.mark.slow
def test_an_unknown_bucket_strategy_is_named(finished_job):
    result = cli("whatif", str(finished_job), "--buckets", "magic:4", timeout=120)
    assert result.returncode == 2 and "--buckets must be" in result.stderr and "Traceback" not in result.stderr


def test_the_shared_prefix_is_a_cached_count_most_records_had_never_one_repeated_lines_hit():
    assert finished._shared_prefix([0, 0, 16, 16, 16, 16]) == 16  # a chat template: the first requests ran before it was cached
    assert finished._shared_prefix([0, 0, 0, 0, 0, 64]) == 0  # one repeated line
    assert finished._shared_prefix([0] * 20 + [64, 64]) == 0  # two of 22 records: under a tenth
    assert finished._shared_prefix([0, 32, 32, 48, 48, 48]) == 48
    assert finished._shared_prefix([]) == 0 and finished._shared_prefix([0, 0]) == 0


def _copy_job(job, folder, edit_records=None, edit_log=None):
    """The finished job's output and step log copied into `folder`, each list of lines edited by a function if given."""
    records = job.read_text().splitlines(keepends=True)
    log = job.with_name("out.jsonl.steps.jsonl").read_text().splitlines(keepends=True)
    output = folder / "out.jsonl"
    output.write_text("".join(edit_records(records) if edit_records else records))
    output.with_name("out.jsonl.steps.jsonl").write_text("".join(edit_log(log) if edit_log else log))
    return output


def _summary(**fields):
    def apply(log):
        return [json.dumps(json.loads(line) | fields) + "\n" if '"kind": "summary"' in line else line for line in log]
    return apply


def _header(edit):
    def apply(log):
        header = json.loads(log[0])
        edit(header)
        return [json.dumps(header) + "\n", *log[1:]]
    return apply


@pytest.mark.slow
def test_a_resumed_runs_log_replays_that_runs_records_only(finished_job, tmp_path):
    def resumed(header):  # a log written before records_before counted the output's records: the lines skipped
        header["resumed"], header["num_skipped"] = True, 2
        del header["records_before"]
    output = _copy_job(finished_job, tmp_path, edit_log=_header(resumed))
    records = [json.loads(line) for line in finished_job.read_text().splitlines()]
    job = finished.read_job(output)
    assert len(job.requests) == 4 and job.ttft_s.tolist() == [r["time_to_first_token_s"] for r in records[2:]]
    assert any("resumed run" in note for note in whatif.whatif(output, progress=False)["notes"])

    def edited(header):  # the input changed before the resume: 2 of its lines were done, but the output held 3 records
        header["resumed"], header["num_skipped"], header["records_before"] = True, 2, 3
    folder = tmp_path / "edited"
    folder.mkdir()
    job = finished.read_job(_copy_job(finished_job, folder, edit_log=_header(edited)))
    assert job.ttft_s.tolist() == [r["time_to_first_token_s"] for r in records[3:]]  # the records this run wrote, not one before it


@pytest.mark.slow
def test_an_input_changed_since_the_job_gives_no_fields_to_the_lines_it_no_longer_holds_and_says_so(finished_job, tmp_path):
    lines = [json.loads(line) for line in finished_job.with_name("in.jsonl").read_text().splitlines()]
    edited = [line | {"priority": 5 - i, "deadline_s": 0.05} | ({"id": f"z{i}"} if i < 4 else {}) for i, line in enumerate(lines)]
    (tmp_path / "edited.jsonl").write_text("".join(json.dumps(line) + "\n" for line in edited))
    job = finished.read_job(_copy_job(finished_job, tmp_path, edit_log=_header(lambda header: header.update(input=str(tmp_path / "edited.jsonl")))))
    assert [r.priority for r in job.requests] == [0, 0, 0, 0, 1, 0] and [r.deadline_s for r in job.requests][:4] == [None] * 4
    assert any(note.startswith("4 input lines (first: ") and "edited.jsonl:1)" in note for note in job.left_out), job.left_out
    (tmp_path / "cut.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines[:3]))
    folder = tmp_path / "cut"
    folder.mkdir()
    job = finished.read_job(_copy_job(finished_job, folder, edit_log=_header(lambda header: header.update(input=str(tmp_path / "cut.jsonl")))))
    assert any(note.startswith("3 records answer lines past the end of") and "(3 lines;" in note for note in job.left_out), job.left_out


@pytest.mark.slow
def test_records_written_twice_are_replayed_once_and_a_step_log_written_for_another_path_is_noted(finished_job, tmp_path):
    job = finished.read_job(_copy_job(finished_job, tmp_path, edit_records=lambda records: records + records))
    assert len(job.requests) == 6 and any(note.startswith("6 lines repeat an earlier record's key") for note in job.left_out), job.left_out
    other = tmp_path / "other"
    other.mkdir()
    (other / "another.jsonl").write_text(finished_job.read_text())
    job = finished.read_job(other / "another.jsonl", finished_job.with_name("out.jsonl.steps.jsonl"))
    assert any(f"was written for {finished_job}, not {other / 'another.jsonl'}" in note for note in job.left_out), job.left_out
    assert not any("was written for" in note for note in finished.read_job(finished_job).left_out)


@pytest.mark.slow
def test_a_line_of_n_samples_is_n_requests_and_one_measured_and_predicted_ttft(finished_job, tmp_path):
    def two_samples(records):
        first = json.loads(records[0])
        first["samples"] = [{"num_generated_tokens": first["num_generated_tokens"]}, {"num_generated_tokens": 3}]
        return [json.dumps(first) + "\n", *records[1:]]

    output = _copy_job(finished_job, tmp_path, edit_records=two_samples)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    job = finished.read_job(output)
    by_line = sorted(records, key=lambda r: r["line"])
    assert len(job.requests) == 7 and job.ttft_s.tolist() == [r["time_to_first_token_s"] for r in by_line]  # one TTFT a line
    first = next(i for i, r in enumerate(by_line) if r["line"] == records[0]["line"])
    assert [r.output_tokens for r in job.requests[first : first + 2]] == [records[0]["num_generated_tokens"], 3]
    assert job.line_starts.tolist() == [i + (i > first) for i in range(6)]
    report = whatif.whatif(output, progress=False, slo_ttft_s=1000.0)
    assert report["measured"]["slo_attainment"] == 1.0 and report["replay"]["slo_attainment"] == 1.0  # six lines, not seven requests
    ttfts = sorted(r["time_to_first_token_s"] for r in records)
    assert report["measured"]["ttft_p50_s"] == pytest.approx((ttfts[2] + ttfts[3]) / 2)


@pytest.mark.slow
def test_a_job_whose_prefill_ran_buckets_its_starting_tables_lack_is_noted_as_refitted(finished_job, tmp_path):
    def refitted(log):  # a refit's chunk bucket in the per-program totals (the header keeps the tables the job started with)
        lines = [json.loads(line) for line in log]
        program = next(line for line in lines if line["kind"] == "program" and line["key"][0] == "prefill")
        program["key"][2] = 40
        return [json.dumps(line) + "\n" for line in lines]

    notes = whatif.whatif(_copy_job(finished_job, tmp_path, edit_log=refitted), progress=False)["notes"]
    assert any("chunk buckets its starting tables lack (40: a refit swapped its tables" in note for note in notes), notes


def _edit_first(**fields):
    """An edit of the output's records: the first one's fields set to these."""
    def edit(records):
        return [json.dumps(json.loads(records[0]) | fields) + "\n", *records[1:]]
    return edit


@pytest.mark.slow
def test_bad_records_logs_and_traces_are_errors_naming_them(finished_job, tmp_path):
    def drop_prompt_count(records):
        first = json.loads(records[0])
        del first["num_prompt_tokens"]
        return [json.dumps(first) + "\n", *records[1:]]

    def null_ttft(records):
        first = json.loads(records[0])
        first["time_to_first_token_s"] = None
        return [json.dumps(first) + "\n", *records[1:]]

    cases = [(dict(edit_records=lambda records: records + ["5\n"]), r"out.jsonl:7: not a JSON record \(a JSON int\)"),
             (dict(edit_records=drop_prompt_count), r"out.jsonl:1: not a jaxinfer or OpenAI batch result record \(no 'num_prompt_tokens'\)"),
             (dict(edit_records=null_ttft), r"out.jsonl:1: the record's time_to_first_token_s is not a number of seconds: None"),
             (dict(edit_records=_edit_first(num_generated_tokens="many")), r"out.jsonl:1: the record's num_generated_tokens is not a count: 'many'"),
             (dict(edit_records=_edit_first(num_prompt_tokens=37.5)), r"out.jsonl:1: the record's num_prompt_tokens is not a count of at least 1: 37.5"),
             (dict(edit_records=_edit_first(line="2")), r"out.jsonl:1: the record's line is not a count of at least 1: '2'"),
             (dict(edit_records=_edit_first(samples=[{"text": "a"}])), r"out.jsonl:1: not a jaxinfer or OpenAI batch result record \(no 'num_generated_tokens'\)"),
             (dict(edit_log=_header(lambda header: header["engine"].update(future_field=1))), r"fields this jaxinfer lacks: future_field"),
             (dict(edit_log=_header(lambda header: header.pop("engine"))), r"holds no engine settings"),
             (dict(edit_log=_header(lambda header: header.update(num_pages=-5))), r"steps.jsonl:1: .*its num_pages is not a count of at least 1: -5"),
             (dict(edit_log=_header(lambda header: header.update(num_skipped="x"))), r"steps.jsonl:1: .*its num_skipped is not a count of at least 0: 'x'"),
             (dict(edit_log=_summary(wall_s="fast")), r"steps.jsonl:\d+: .*its wall_s is not a number of seconds: 'fast'"),
             (dict(edit_log=_summary(wall_s=float("nan"))), r"steps.jsonl:\d+: .*its wall_s is not a number of seconds: nan"),
             (dict(edit_log=_header(lambda header: header.update(records_before=None))), r"steps.jsonl:1: .*its records_before is not a count of at least 0: None")]
    for i, (edits, message) in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        with pytest.raises(ValueError, match=message):
            finished.read_job(_copy_job(finished_job, folder, **edits))
    old = tmp_path / "old"  # a log written before an epoch under a policy that orders none was refused: replayed without it
    old.mkdir()
    job = finished.read_job(_copy_job(finished_job, old, edit_log=_header(lambda header: header["engine"].update(policy="fcfs", policy_epoch=4))))
    assert job.engine_config.policy_epoch is None
    torn = _copy_job(finished_job, tmp_path, edit_records=lambda records: records + ['{"line": 7, "status": "o'])  # a killed job's last line
    job = finished.read_job(torn)
    assert len(job.requests) == 6 and any("out.jsonl:7, is torn" in note for note in job.left_out), job.left_out
    with pytest.raises(ValueError, match=r"a directory, not an output file"):
        finished.read_job(tmp_path)
    with pytest.raises(ValueError, match=r"--step-log .*none.jsonl: no such file"):
        finished.read_job(finished_job, tmp_path / "none.jsonl")
    (tmp_path / "inf.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,40,12\ninf,30,5\n")
    with pytest.raises(ValueError, match=r"inf.csv:3: TIMESTAMP='inf' is not a time"):  # the trace's reader names it
        whatif.whatif(finished_job, trace=tmp_path / "inf.csv", progress=False)
    (tmp_path / "far.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,40,12\n1e308,30,5\n")
    with pytest.raises(ValueError, match=r"far.csv: request 2's arrival is not a finite time \(1e\+308 s / --rate 1e-09\)"):
        whatif.whatif(finished_job, trace=tmp_path / "far.csv", rate=1e-9, progress=False)


@pytest.mark.slow
def test_an_openai_batch_job_is_replayed_in_input_order_with_its_cached_prefix(tmp_path, compile_cache):
    """Chat lines whose first one generates the most, so the results are written in another order than the input's,
    a chat template every prompt shares, and a last line of a higher priority (-1, in its body): the replay, put back
    in input order by custom_id with the cached tokens of usage.prompt_tokens_details and the priority, runs the job's
    steps with its padding."""
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "default", "messages": [{"role": "user", "content": q}], "max_tokens": 24 - 4 * i, **({"priority": -1} if i == 4 else {})}}
             for i, q in enumerate(QUESTIONS[:5])]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out.jsonl"
    result = cli("generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(output), "--compile-cache", compile_cache,
                 *ENGINE_FLAGS[:2], "--max-num-seqs", "2", *ENGINE_FLAGS[4:])
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["custom_id"] for r in records] != [line["custom_id"] for line in lines]  # written as they finished
    assert max(r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in records) > 0
    summary = next(json.loads(line) for line in output.with_name("out.jsonl.steps.jsonl").read_text().splitlines() if '"summary"' in line)
    assert [r.priority for r in finished.read_job(output).requests] == [0, 0, 0, 0, -1]  # read from the body, as the job read it
    report = whatif_json(output)
    assert report["replay"]["num_steps"] == summary["num_steps"] and report["replay"]["padding"] == pytest.approx(summary["padding"], abs=1e-6)
    assert report["notes"] == []
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line | {"custom_id": "renamed-" + line["custom_id"]}) + "\n" for line in lines))
    job = finished.read_job(output)  # the input changed since: no record's custom_id is in it
    assert [r.priority for r in job.requests] == [0] * 5 and any(note.startswith("5 records' custom_ids (first: ") for note in job.left_out), job.left_out


@pytest.mark.slow
def test_the_whatif_command_imports_no_jax(finished_job):
    code = f"import sys; from jaxinfer.cli import main; assert main(['whatif', {str(finished_job)!r}, '--json']) == 0; print('jax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("False"), result.stderr[-2000:]


@pytest.mark.slow
def test_a_setting_that_refuses_a_request_names_its_input_line_and_leaves_the_grids_other_settings(finished_job):
    with pytest.raises(whatif.Refused, match=r"input line \d cannot run under these settings"):
        whatif.whatif(finished_job, num_pages=2, progress=False)
    report = whatif.whatif(finished_job, num_pages=[2, 65], progress=False)
    refused, ran = report["grid"]
    assert refused["predicted"] is None and "cannot run under these settings" in refused["refused"] and ran["best"]
    assert report["changes"] == {"num_pages": 65} and "refused: input line" in whatif.format_report(report)


@pytest.mark.slow
def test_lines_that_timed_out_are_replayed_with_their_deadlines_and_count_against_the_slo(tmp_path, compile_cache):
    """One sequence at a time, the earliest deadline first: of the four lines in flight at the start, each with a
    deadline of 50 ms, those whose deadline passes before their turn time out in the job. Their records keep their prompt's size, so the replay queues them too, with their deadlines, and the SLO's share
    counts them as misses, measured and replayed alike."""
    lines = [{"id": f"d{i}", "messages": [{"role": "user", "content": q}], "max_tokens": 20, **({"deadline_s": 0.05} if i < 4 else {})}
             for i, q in enumerate(QUESTIONS)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out.jsonl"
    result = cli("generate", "--input", str(tmp_path / "in.jsonl"), "--output", str(output), "--compile-cache", compile_cache,
                 *ENGINE_FLAGS[:2], "--max-num-seqs", "1", *ENGINE_FLAGS[4:], "--policy", "edf")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    timed_out = [r for r in records if r["status"] == "error"]
    assert timed_out and all(r["finish_reason"] == "timeout" and r["num_prompt_tokens"] > 0 for r in timed_out)
    job = finished.read_job(output)
    assert len(job.requests) == 6 and [r.deadline_s for r in job.requests] == [0.05] * 4 + [None] * 2  # the first 4 lines are in flight at once
    assert int(np.isnan(job.ttft_s).sum()) == len(timed_out)
    report = whatif.whatif(output, progress=False, slo_ttft_s=1000.0)
    assert report["measured"]["slo_attainment"] == round(1 - len(timed_out) / 6, 4)
    assert report["replay"]["finish_reasons"].get("timeout", 0) >= 1 and report["notes"] == []


@pytest.mark.slow
def test_a_timed_out_embedding_or_prompt_only_line_replays_as_its_prefill_and_a_zero_default_is_no_error(finished_job, tmp_path):
    """A line that timed out replays as it would have run: an embedding line and a line of max_tokens 0 (prompt logprobs
    only) generate nothing, one of another max_tokens that many, a line without one the job's default, even a default of
    0 (a scoring job's)."""
    lines = [json.loads(line) for line in finished_job.with_name("in.jsonl").read_text().splitlines()]
    edits = [{"embed": True}, {"max_tokens": 0, "prompt_logprobs": 0}, {"max_tokens": None, "max_completion_tokens": 5}, {}]  # 5: OpenAI's name
    edited = [line | {"deadline_s": 0.05} | edit for line, edit in zip(lines, edits)]
    del edited[3]["max_tokens"]
    (tmp_path / "edited.jsonl").write_text("".join(json.dumps(line) + "\n" for line in [*edited, *lines[4:]]))

    def timed_out(records):
        out = []
        for raw in records:
            r = json.loads(raw)
            if r["line"] <= 4:
                r = {k: r[k] for k in ("id", "line", "key", "num_prompt_tokens")} | {
                    "status": "error", "error": f"line {r['line']}: timed out: its deadline passed before it started", "finish_reason": "timeout"}
            out.append(json.dumps(r) + "\n")
        return out

    for default, line_4 in ((128, 128), (0, 1)):
        folder = tmp_path / f"default_{default}"
        folder.mkdir()
        log = _header(lambda header: header.update(input=str(tmp_path / "edited.jsonl"), default_max_tokens=default))
        job = finished.read_job(_copy_job(finished_job, folder, edit_records=timed_out, edit_log=log))
        assert [r.output_tokens for r in job.requests[:4]] == [1, 1, 5, line_4] and [r.deadline_s for r in job.requests[:4]] == [0.05] * 4
