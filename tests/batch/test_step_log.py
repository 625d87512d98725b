"""The step log beside a job's output: every step in full up to a bound, then only per-program totals. Host only."""

import json

import pytest

from jaxinfer.batch.step_log import StepLog, engine_settings, log_path, read_step_log
from jaxinfer.config import EngineConfig
from jaxinfer.scheduling import runloop
from jaxinfer.scheduling.step_costs import StepCosts

from fakes import small_config


class TickClock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def real_plans():
    plans, _ = runloop.dry_run(small_config(), [[i + 1] * (3 + i) for i in range(6)], [4] * 6, num_pages=40)
    return plans


def write_log(path, plans, *, full_steps, device=0.5, host=0.25, costs=None):
    clock = TickClock()
    log = StepLog(path, {"input": "in.jsonl", "engine": engine_settings(small_config())}, costs=costs, full_steps=full_steps, clock=clock)
    for plan in plans:
        clock.now += host + device  # the host's gap, then the step
        log(plan, None, device)
    log.close()
    return log


def test_every_step_is_written_up_to_the_bound_and_the_totals_cover_them_all(tmp_path):
    plans = real_plans()
    path = tmp_path / "out.jsonl.steps.jsonl"
    write_log(path, plans, full_steps=3)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [line["kind"] for line in lines]
    keys = {plan.bucket for plan in plans}
    assert kinds == ["header"] + ["step"] * 3 + ["program"] * len(keys) + ["summary"]
    steps = lines[1:4]
    assert [s["key"] for s in steps] == [list(p.bucket) for p in plans[:3]]
    assert [s["t"] for s in steps] == [0.0, 0.75, 1.5]  # seconds from the first step's start
    assert [s["host_s"] for s in steps] == [0.0, 0.25, 0.25]  # the first step has no gap before it
    assert all(s["device_s"] == 0.5 for s in steps)
    programs = [line for line in lines if line["kind"] == "program"]
    assert sum(p["steps"] for p in programs) == len(plans)
    assert sum(p["real_tokens"] for p in programs) == sum(p.num_real_tokens for p in plans)
    summary = lines[-1]
    padded = sum(p.bucket.num_rows * p.bucket.num_tokens for p in plans)
    assert summary["wall_s"] == pytest.approx(0.75 * len(plans) - 0.25)
    assert summary["padding"] == pytest.approx(1 - sum(p.num_real_tokens for p in plans) / padded, abs=1e-6)


def test_the_log_stays_bounded_however_many_steps_run(tmp_path):
    plans = real_plans() * 200
    path = tmp_path / "big.steps.jsonl"
    write_log(path, plans, full_steps=10)
    assert len(path.read_text().splitlines()) == 1 + 10 + len({p.bucket for p in plans}) + 1


def test_host_gaps_refine_the_cost_tables_host_line_and_the_table_is_written(tmp_path):
    costs = StepCosts()
    path = tmp_path / "c.steps.jsonl"
    write_log(path, real_plans(), full_steps=100, costs=costs)
    assert costs.host_seconds(2) == pytest.approx(0.25)
    contents = read_step_log(path)
    assert contents.costs is not None and contents.costs.host_seconds(3) == pytest.approx(0.25)
    assert contents.header["input"] == "in.jsonl" and contents.summary["num_steps"] == len(real_plans())
    assert EngineConfig(**contents.header["engine"]) == small_config()  # the settings replay as they were


def test_a_chained_hooks_seconds_count_in_the_wall_time_not_as_the_next_steps_host_time(tmp_path):
    clock, costs = TickClock(), StepCosts()

    def compile_turn(plan, tokens, seconds):  # a refit giving its compile a turn after the step
        clock.now += 0.6

    log = StepLog(tmp_path / "h.steps.jsonl", {"input": "in.jsonl", "engine": engine_settings(small_config())}, costs=costs, clock=clock, chain=compile_turn)
    plans = real_plans()
    for plan in plans:
        clock.now += 0.25 + 0.5  # the host's gap, then the step
        log(plan, None, 0.5)
    log.close()
    steps = [line for line in map(json.loads, (tmp_path / "h.steps.jsonl").read_text().splitlines()) if line["kind"] == "step"]
    assert [s["host_s"] for s in steps] == [0.0] + [0.25] * (len(plans) - 1) and costs.host_seconds(2) == pytest.approx(0.25)
    assert log.summary()["wall_s"] == pytest.approx(1.35 * len(plans) - 0.25 - 0.6)  # from the first step's start to the last one's end


def test_a_torn_last_line_is_dropped_and_anything_else_is_named(tmp_path):
    path = tmp_path / "t.steps.jsonl"
    write_log(path, real_plans(), full_steps=100)
    text = path.read_text()
    path.write_text(text[: text.rindex('{"kind": "summary"') + 20])  # killed while writing the summary
    contents = read_step_log(path)
    assert contents.summary is None and len(contents.steps) == len(real_plans())
    path.write_text('{"kind": "step"}\n')
    with pytest.raises(ValueError, match="not a jaxinfer step log"):
        read_step_log(path)
    header = text.splitlines()[0]
    path.write_text("\n" + '{"kind": "header", "format": "someone-elses-log/9"}\n')  # a blank first line hides no foreign header
    with pytest.raises(ValueError, match="not a jaxinfer step log"):
        read_step_log(path)
    path.write_text(header + "\n" + header + "\n")
    with pytest.raises(ValueError, match=r":2: a second header"):
        read_step_log(path)
    bad_costs = '{"kind": "costs", "table": {"format": "jaxinfer-step-costs/1", "programs": [["decode", 1, 1, 1]]}}'
    path.write_text(header + "\n" + bad_costs + "\n")
    with pytest.raises(ValueError, match=r":2: not a step-log line \(ValueError: programs must be a list of objects"):
        read_step_log(path)
    step = json.loads(text.splitlines()[1])
    for broken, message in ((step | {"rows": "4"}, r":2: not a step-log line \(TypeError: its rows is not an int: '4'\)"),
                            ({k: v for k, v in step.items() if k != "device_s"}, r":2: not a step-log line \(KeyError: 'device_s'\)"),
                            (step | {"key": []}, r':2: not a step-log line \(TypeError: its key is not \["prefill" or "decode", rows'),
                            ({"kind": "program"}, r":2: not a step-log line \(KeyError: 'key'\)"),
                            ({"kind": "program", "key": ["decode", 4, 1, 0]}, r":2: not a step-log line \(TypeError: its key is not")):
        path.write_text(header + "\n" + json.dumps(broken) + "\n")
        with pytest.raises(ValueError, match=message):
            read_step_log(path)
    path.write_text(header.replace("jaxinfer-step-log/1", "jaxinfer-step-log/2") + "\n")
    with pytest.raises(ValueError, match=r"a step log of another format \(jaxinfer-step-log/2; this jaxinfer reads jaxinfer-step-log/1\)"):
        read_step_log(path)
    path.write_bytes(header.encode() + b"\n\xff\n")
    with pytest.raises(ValueError, match=r"t.steps.jsonl: not UTF-8 text"):
        read_step_log(path)


def test_the_log_lies_beside_the_outputs_real_path(tmp_path):
    target = tmp_path / "real.jsonl"
    target.write_text("")
    (tmp_path / "link.jsonl").symlink_to(target)
    assert log_path(tmp_path / "link.jsonl") == tmp_path / "real.jsonl.steps.jsonl"
