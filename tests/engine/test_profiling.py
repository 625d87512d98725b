"""jax.profiler traces of chosen engine steps: from LLM.start_profile / stop_profile, from a
StepProfiler hook, and from `jaxinfer generate --profile DIR --profile-steps A:B`. Each trace must hold
a TensorBoard file (*.xplane.pb) and a Perfetto file that parses, with the engine's step programs in it."""

import glob
import json
import subprocess
import sys

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine import profiling


@pytest.fixture(scope="module")
def llm(tiny_chat_model, compile_cache):
    return LLM(str(tiny_chat_model), max_context=128, page_size=16, max_num_seqs=2, max_prefill_tokens=32, compilation_cache_dir=compile_cache)


def step_programs(directory) -> list[float]:
    """Start times of the engine steps in the trace: their forward programs (jax nests two events per call: the outer ones)."""
    assert glob.glob(f"{directory}/**/*.xplane.pb", recursive=True), "no TensorBoard file"
    events = sorted((e["ts"], e["ts"] + e["dur"]) for e in profiling.trace_events(directory) if e.get("ph") == "X" and e.get("name", "").startswith("PjitFunction(jit(_forward_step"))
    outer, end = [], -1.0
    for start, stop in events:
        if start > end:
            outer.append(start)
        end = max(end, stop)
    return outer


def test_start_and_stop_profile_trace_what_runs_between(llm, tmp_path):
    llm.generate(["warm up"], SamplingParams(temperature=0, max_tokens=2))
    llm.start_profile(tmp_path / "trace")
    llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=4))
    llm.stop_profile()
    assert step_programs(tmp_path / "trace")


def test_step_profiler_traces_only_steps_a_to_b(llm, tmp_path):
    counted = []
    profiler = profiling.StepProfiler(tmp_path / "steps", 3, 4, then=lambda *step: counted.append(step))
    llm.generate(["count to ten"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), on_step=profiler)
    profiler.close()
    assert profiler.traced == (3, 4) and profiler.steps == len(counted) >= 6 and not profiler.tracing
    assert len(step_programs(tmp_path / "steps")) == 2  # the two steps, not the run
    for bad in ("0:3", "5:2", "x", "1:2:3"):
        with pytest.raises(ValueError, match="--profile-steps"):
            profiling.parse_steps(bad)
    assert profiling.parse_steps("7") == (7, 7)


@pytest.mark.slow
def test_generate_profile_writes_a_trace_of_the_chosen_steps(tiny_chat_model, compile_cache, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": f"Question {i}?", "max_tokens": 6}) + "\n" for i in range(3)))
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(tiny_chat_model), "--input", str(inp), "--output", str(tmp_path / "out.jsonl"),
         "--compile-cache", compile_cache, "--max-context", "128", "--max-num-seqs", "2", "--page-size", "16",  # 13 programs, not 25
         "--no-progress", "--profile", str(tmp_path / "p"), "--profile-steps", "2:3"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "profile: steps 2..3" in result.stderr and len(step_programs(tmp_path / "p")) == 2
    bad = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "generate", "--prompt", "x", "--profile", "d", "--profile-steps", "3:1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--profile-steps '3:1'" in bad.stderr
