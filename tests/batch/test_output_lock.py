"""One job per output file, whatever name reaches it: the lock is on the output itself (a symlink or a hard
link to it is the same output), its settings are found through a symlink, and the `OUTPUT.lock` note is
never followed or truncated when the job did not create it (a planted link there is refused, its target
untouched). No model runs here: every check happens when the job is constructed."""

import json
import os
from pathlib import Path

import pytest

from jaxinfer.batch.job import BatchJob
from jaxinfer.batch.output_file import OutputBusyError, ResumeError, lock_path, meta_path
from jaxinfer.scheduling.request import SamplingParams

DEFAULTS = SamplingParams(temperature=0, max_tokens=4)
VICTIM_BYTES = b"precious data, not a lock\n" * 100


def write_input(path: Path) -> Path:
    path.write_text('{"id":"a","prompt":"x"}\n{"id":"b","prompt":"y"}\n', "utf-8")
    return path


def test_a_second_job_through_a_symlink_or_a_hard_link_to_the_output_is_refused(tmp_path):
    inp, out = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    out.write_bytes(b"")
    soft, hard = tmp_path / "soft.jsonl", tmp_path / "hard.jsonl"
    with BatchJob(inp, out, DEFAULTS, resume=True):
        os.symlink(out, soft)
        os.link(out, hard)
        with pytest.raises(OutputBusyError, match=f"in use by another jaxinfer job \\(pid {os.getpid()}\\)"):
            BatchJob(inp, soft, DEFAULTS, resume=True)
        with pytest.raises(OutputBusyError, match="in use by another jaxinfer job"):
            BatchJob(inp, hard, DEFAULTS, resume=True)
    with BatchJob(inp, soft, DEFAULTS, resume=True) as job:  # released: a job through the link now runs
        assert len(job.todo) == 2
    assert out.read_bytes() == b"" and not lock_path(out).exists() and not lock_path(soft).exists()


def test_a_resume_through_a_symlink_to_the_output_checks_the_output_s_own_settings(tmp_path):
    inp, out, link = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl", tmp_path / "link.jsonl"
    with BatchJob(inp, out, DEFAULTS, settings={"model": {"name": "a.gguf"}}) as job:
        job.write([{"id": "a", "line": 1, "key": 'id:"a"', "status": "error", "error": "line 1: x"}])  # one line's record
    os.symlink(out, link)
    with BatchJob(inp, link, DEFAULTS, resume=True, settings={"model": {"name": "a.gguf"}}) as job:
        assert job.summary.num_skipped == 1 and len(job.todo) == 1
    with pytest.raises(ResumeError, match='"a.gguf"} -> {"name": "b.gguf"'):
        BatchJob(inp, link, DEFAULTS, resume=True, settings={"model": {"name": "b.gguf"}})


@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_a_planted_link_at_the_lock_path_is_refused_and_its_target_left_whole(tmp_path, link):
    inp, out = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM_BYTES)
    (os.symlink if link == "symlink" else os.link)(victim, lock_path(out))
    with pytest.raises(ValueError, match=f"{lock_path(out).name} is a {link}"):
        BatchJob(inp, out, DEFAULTS)
    assert victim.read_bytes() == VICTIM_BYTES and not out.exists()


def test_a_lock_file_of_another_owner_is_refused_and_left_whole(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another owner needs root")
    inp, out = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    lock_path(out).write_bytes(b"12345\n")
    os.chown(lock_path(out), 54321, 54321)
    with pytest.raises(ValueError, match="belongs to another user"):
        BatchJob(inp, out, DEFAULTS)
    assert lock_path(out).read_bytes() == b"12345\n"


def test_a_stale_lock_file_left_by_a_killed_job_does_not_stop_the_next_job(tmp_path):
    inp, out = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    lock_path(out).write_bytes(b"99999\n")  # what a SIGKILLed job leaves: no process holds its lock
    with BatchJob(inp, out, DEFAULTS) as job:
        assert lock_path(out).read_text().strip() == str(os.getpid()) and len(job.todo) == 2
    assert not lock_path(out).exists()


@pytest.mark.parametrize("which", ["lock", "settings"])
def test_a_directory_at_the_lock_or_settings_path_is_one_clear_error_before_anything_runs(tmp_path, which):
    inp, out = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    path = lock_path(out) if which == "lock" else meta_path(out)
    path.mkdir()
    with pytest.raises(ValueError, match=f"{path.name} is a directory"):
        BatchJob(inp, out, DEFAULTS)
    assert path.is_dir() and not out.exists()


def test_a_job_refused_while_it_is_constructed_leaves_no_output_behind(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "j", "prompt": "x"}) + "\n" + json.dumps({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x"}}) + "\n")
    with pytest.raises(ValueError, match="a file holds one format"):
        BatchJob(inp, out, DEFAULTS)
    assert not out.exists() and not lock_path(out).exists()
