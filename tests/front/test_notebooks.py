"""The notebooks run end to end on a small sample (nbclient, the python3 kernel of the running venv).

Each test appends one probe cell to its notebook (in memory only), which prints as JSON the values the
notebook computed; the assertions are about those values (what the strategies cost, what the engine
did), checked against numpy where they can be recomputed, not about how the tables are laid out.
Executing a notebook takes seconds to a minute, so every test here is `slow`.
"""

import json
import pathlib
import re

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
PROBE_MARK = "NOTEBOOK-PROBE "

pytestmark = pytest.mark.slow


def _execute(name: str, monkeypatch, probe: str | None = None, *, cell_timeout: int = 120, **environment) -> nbformat.NotebookNode:
    """Run the notebook; `probe`, an expression over its variables, is printed as JSON by a last cell. A cell
    running past `cell_timeout` seconds fails the test."""
    for key, value in environment.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    if probe is not None:
        source = f"import json as _json\nprint({PROBE_MARK!r} + _json.dumps({probe}, default=lambda x: x.item()))"
        notebook.cells.append(nbformat.v4.new_code_cell(source))  # numpy scalars -> Python numbers
    # jupyter_client starts kernel.json's "python" as sys.executable, i.e. this venv's interpreter.
    resources = {"metadata": {"path": str(NOTEBOOKS)}}  # the kernel's working directory
    client = NotebookClient(notebook, timeout=cell_timeout, kernel_name="python3", resources=resources)
    return client.execute()


def _stream_text(notebook: nbformat.NotebookNode) -> str:
    return "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )


def _probed(notebook: nbformat.NotebookNode):
    (line,) = [line for line in _stream_text(notebook).splitlines() if line.startswith(PROBE_MARK)]
    return json.loads(line[len(PROBE_MARK) :])


def _num_images(notebook: nbformat.NotebookNode) -> int:
    return sum("image/png" in o.get("data", {}) for c in notebook.cells if c.cell_type == "code" for o in c.outputs)


STRATEGIES_PROBE = """{"budget": BUDGET, "lengths": lengths.tolist(), "fitted": list(fitted.buckets),
 "rows": [[m.strategy, m.num_programs, m.token_waste, m.num_over_top] for _, m in results]}"""


def test_bucket_strategies_notebook_runs_on_small_sample(monkeypatch):
    notebook = _execute("bucket_strategies.ipynb", monkeypatch, STRATEGIES_PROBE, JAXINFER_NB_SAMPLE="2000")
    probe = _probed(notebook)
    lengths, fitted = np.array(probe["lengths"]), np.array(probe["fitted"])
    assert len(lengths) == 2000 and len(fitted) <= probe["budget"] and fitted[-1] == lengths.max()
    waste = {strategy: token_waste for strategy, _, token_waste, _ in probe["rows"]}
    assert all(programs <= probe["budget"] and over_top == 0 for _, programs, _, over_top in probe["rows"])
    padded = fitted[np.searchsorted(fitted, lengths)]  # each prompt padded to the first bucket that holds it
    assert waste["fitted"] == pytest.approx(1 - lengths.sum() / padded.sum())
    assert waste["pad-to-max"] == pytest.approx(1 - lengths.sum() / (lengths.max() * len(lengths)))
    assert waste["fitted"] == min(waste.values()) < waste["pad-to-max"] == max(waste.values())  # the fit is optimal
    assert "mean+k-sigma policy: cap" in _stream_text(notebook)
    assert _num_images(notebook) == 1


def test_bucket_strategies_notebook_falls_back_to_synthetic_without_trace(monkeypatch, tmp_path):
    absent = str(tmp_path / "absent.csv")
    notebook = _execute("bucket_strategies.ipynb", monkeypatch, "[source, trace.num_requests]", JAXINFER_NB_SAMPLE="1000", JAXINFER_NB_TRACE=absent)
    assert _probed(notebook) == ["synthetic (no trace file found)", 1000]


QUICKSTART_PROBE = """{"num_params": llm.model_config.num_params(), "num_compilations": llm.engine.num_compilations,
 "num_keys": len(llm.engine.program_keys()), "outputs": [[o.finish_reason, o.num_generated_tokens] for o in outputs],
 "reply": reply.text, "padding_waste": stats.padding_waste, "num_preemptions": stats.num_preemptions}"""


def test_quickstart_notebook_generates_and_chats_with_the_default_model(monkeypatch):
    notebook = _execute("quickstart.ipynb", monkeypatch, QUICKSTART_PROBE)
    probe, text = _probed(notebook), _stream_text(notebook)
    assert probe["num_params"] == 134_515_008 and f"{probe['num_params']:,} parameters" in text
    assert probe["num_compilations"] == probe["num_keys"], "a program was compiled after warm-up"
    assert probe["outputs"] == [["length", 24]] * 3  # max_tokens=24, greedy, no stop
    assert "Paris" in probe["reply"] and probe["num_preemptions"] == 0
    (shown,) = re.findall(r"padding waste ([\d.]+)%", text)
    assert 0 < probe["padding_waste"] < 1 and float(shown) == pytest.approx(100 * probe["padding_waste"], abs=0.05)


ENGINE_PROBE = """{"rows": [{k: r.get(k) for k in ("strategy", "budget", "programs", "padding_waste", "error")} for r in result["traces"][0]["rows"]],
 "reference_check": result["traces"][0]["reference_check"], "agreement": result["traces"][0]["agreement_all_configurations"]["exact_requests"]}"""


def test_buckets_on_engine_notebook_measures_strategies_on_the_engine(monkeypatch, tmp_path):
    notebook = _execute("buckets_on_engine.ipynb", monkeypatch, ENGINE_PROBE, JAXINFER_NB_SAMPLE="4", JAXINFER_NB_OUT=str(tmp_path))
    probe = _probed(notebook)
    rows = {(r["strategy"], r["budget"]): r for r in probe["rows"]}
    assert sorted(rows) == [("fitted", 4), ("fitted", 8), ("pad-to-max", 4), ("pad-to-max", 8)]
    assert all(r["error"] is None and 0 < r["programs"] <= r["budget"] for r in rows.values())
    assert rows["pad-to-max", 8]["padding_waste"] == rows["pad-to-max", 4]["padding_waste"]  # one bucket whatever the budget
    assert rows["fitted", 8]["padding_waste"] < rows["pad-to-max", 8]["padding_waste"]
    check = probe["reference_check"]
    assert check["num_checked"] == 3 and check["num_equal"] == 3  # dense generate.generate, greedy
    assert probe["agreement"] == 1.0  # greedy tokens identical across every configuration
    assert "naive dense" in _stream_text(notebook)
    assert (tmp_path / "buckets_on_engine_pareto_ttft_throughput.png").stat().st_size > 10_000
    assert _num_images(notebook) == 2


LAB_PROBE = """{"policies": list(POLICIES), "compared": compared, "frontier": frontier, "rates": list(RATES), "rows": rows,
 "costs": costs.to_json(), "engine": {k: v for k, v in dataclasses.asdict(llm.engine_config).items() if k != "buckets"},
 "num_pages": llm.engine.num_pages, "compare_rate": COMPARE_RATE, "requests": [dataclasses.asdict(r) for r in trace_requests(COMPARE_RATE)]}"""


def test_scheduling_lab_compares_policies_draws_frontiers_and_puts_predictions_beside_real_runs(monkeypatch):
    from jaxinfer.config import POLICIES, EngineConfig
    from jaxinfer.scheduling.simulator import SimRequest, simulate
    from jaxinfer.scheduling.step_costs import StepCosts

    # Its real runs load, compile and time the default model: on a loaded 2-core machine a cell took over 120 s.
    notebook = _execute("scheduling_lab.ipynb", monkeypatch, LAB_PROBE, cell_timeout=300, JAXINFER_NB_SAMPLE="120", JAXINFER_NB_REAL="4")
    probe = _probed(notebook)
    assert probe["policies"] == list(POLICIES) and [r["policy"] for r in probe["compared"]] == list(POLICIES)
    compared = {r["policy"]: r for r in probe["compared"]}
    # the notebook's fcfs row, simulated again here from the same requests, costs and engine
    engine = EngineConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in probe["engine"].items()} | {"policy": "fcfs"})
    again = simulate(engine, [SimRequest(**r) for r in probe["requests"] if r.update(deadline_s=None) is None], StepCosts.from_json(probe["costs"]), num_pages=probe["num_pages"])
    assert compared["fcfs"]["ttft_p99_s"] == pytest.approx(again.summary()["ttft_p99_s"], rel=1e-4)  # the costs JSON keeps 7 decimals
    # Only edf sheds. It must shed where the load misses its 30 s deadline under fcfs: the conversation trace at the
    # notebook's rate does; the synthetic fallback (no trace folder, as in a clean clone) may stay under capacity.
    assert all(r["timeouts"] == 0 for p, r in compared.items() if p != "edf")
    if compared["fcfs"]["ttft_p99_s"] > 30.0:
        assert compared["edf"]["timeouts"] > 0
    for policy, points in probe["frontier"].items():
        assert [p["rate"] for p in points] == probe["rates"]
        # More load never costs throughput: the highest rate's is at least the lowest's, within 5%. (Not strictly
        # above it: the costs are this machine's, measured in the notebook, and on a loaded machine even the lowest
        # rate saturates it, so the two differ by noise: 2.134 against 2.106 tokens/s once. Not near the best
        # either.) Except what a policy sheds: past its deadlines edf drops requests, and their output tokens with
        # them (on an AVX2-only AMD EPYC, whose costs are ~3x, 2.818 against 3.143 tokens/s once).
        throughput = [p["output_tokens_per_s"] for p in points]
        assert throughput[0] > 0 and (throughput[-1] >= 0.95 * throughput[0] or points[-1]["timeouts"] > points[0]["timeouts"]), (policy, points)
    assert [r["policy"] for r in probe["rows"]] == ["fcfs", "shortest-prompt"]
    assert all(0.5 < r["predicted_wall_s"] / r["wall_s"] < 2.0 for r in probe["rows"])  # loose: a shared, loaded machine
    assert _num_images(notebook) == 1
