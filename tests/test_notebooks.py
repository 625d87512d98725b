"""The notebooks run end to end on a small sample (nbclient, the python3 kernel of the running venv)."""

import pathlib

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"


def _execute(name: str, monkeypatch, **environment) -> nbformat.NotebookNode:
    for key, value in environment.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    # jupyter_client starts kernel.json's "python" as sys.executable, i.e. this venv's interpreter.
    resources = {"metadata": {"path": str(NOTEBOOKS)}}  # the kernel's working directory
    client = NotebookClient(notebook, timeout=120, kernel_name="python3", resources=resources)
    return client.execute()


def _stream_text(notebook: nbformat.NotebookNode) -> str:
    return "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )


def test_bucket_strategies_notebook_runs_on_small_sample(monkeypatch):
    notebook = _execute("bucket_strategies.ipynb", monkeypatch, JAXINFER_NB_SAMPLE="2000")
    text = _stream_text(notebook)
    assert ": 2000 requests" in text
    assert "fitted buckets:" in text and "mean+k-sigma policy: cap" in text
    images = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1


def test_bucket_strategies_notebook_falls_back_to_synthetic_without_trace(monkeypatch, tmp_path):
    absent = str(tmp_path / "absent.csv")
    notebook = _execute("bucket_strategies.ipynb", monkeypatch, JAXINFER_NB_SAMPLE="1000", JAXINFER_NB_TRACE=absent)
    assert "synthetic (no trace file found): 1000 requests" in _stream_text(notebook)


def test_quickstart_notebook_generates_and_chats_with_the_default_model(monkeypatch):
    text = _stream_text(_execute("quickstart.ipynb", monkeypatch))
    assert "134,515,008 parameters" in text
    assert text.count("tokens, ttft") == 3
    assert "Paris" in text and "padding waste" in text


def test_buckets_on_engine_notebook_measures_strategies_on_the_engine(monkeypatch, tmp_path):
    notebook = _execute("buckets_on_engine.ipynb", monkeypatch, JAXINFER_NB_SAMPLE="4", JAXINFER_NB_OUT=str(tmp_path))
    text = _stream_text(notebook)
    assert "4 requests, scale 16" in text
    assert "reference check (dense generate.generate): 3/3 requests equal" in text
    header = next(line for line in text.splitlines() if line.startswith("strategy"))
    assert header.split()[:9] == ["strategy", "B", "c/r/p", "progs", "cold", "s", "warm", "s", "pad"] and "ttft p99" in header
    assert "pad-to-max      4" in text and "fitted          8" in text and "error" not in text
    assert "greedy tokens identical across every configuration:" in text and "naive dense" in text
    assert (tmp_path / "buckets_on_engine_pareto_ttft_throughput.png").stat().st_size > 10_000
    images = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2
