"""`jaxinfer whatif` end to end: a real job on the default model, then its replay and a prediction under other settings."""

import dataclasses
import json
import subprocess
import sys

import pytest

from jaxinfer import whatif

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


@pytest.mark.slow
def test_a_new_limit_cuts_the_jobs_own_table_at_it_and_adds_it(finished_job):
    job = whatif.read_job(finished_job)
    engine = job.log.header["engine"] | {"prefill_chunk_buckets": [32, 80, 160, 224], "decode_batch_buckets": [1, 2, 4]}  # as a planned job's log holds them
    planned = dataclasses.replace(job, log=dataclasses.replace(job.log, header=job.log.header | {"engine": engine}))
    cfg = whatif.new_config(planned, max_prefill_tokens=100, max_num_seqs=8)
    assert (cfg.prefill_chunk_buckets, cfg.decode_batch_buckets, cfg.max_prefill_tokens, cfg.max_num_seqs) == ((32, 80, 100), (1, 2, 4, 8), 100, 8)
    cfg = whatif.new_config(planned, max_prefill_tokens=400, max_num_seqs=2)
    assert (cfg.prefill_chunk_buckets, cfg.decode_batch_buckets) == ((32, 80, 160, 224, 256), (1, 2))  # a chunk is at most max_context (256)
    assert whatif.new_config(planned, num_pages=40).decode_batch_buckets == (1, 2, 4)  # a change of no limit keeps the tables


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
