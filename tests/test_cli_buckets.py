"""`jaxinfer buckets fit`, driven through the parser that `add_subparser` registers."""

import argparse

import pytest

from jaxinfer.buckets import FixedList, padding_metrics
from jaxinfer.cli_buckets import add_subparser, format_table
from jaxinfer.traces import save_trace, synthetic_trace

STRATEGY_NAMES = ("pad-to-max", "powers-of-two", "linear", "quantile", "mean+k-sigma", "fitted")


def _run(argv):
    parser = argparse.ArgumentParser(prog="jaxinfer")
    add_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "trace.csv"
    save_trace(synthetic_trace(500, seed=0), path)
    return path


def test_fit_prints_buckets_and_compares_every_strategy(trace_path, capsys):
    assert _run(["buckets", "fit", "--trace", str(trace_path), "--budget", "6"]) == 0
    out = capsys.readouterr().out
    fitted_line = next(line for line in out.splitlines() if line.startswith("fitted buckets"))
    assert len(fitted_line.split(":", 1)[1].split(",")) == 6
    for name in STRATEGY_NAMES:
        assert f"\n{name} " in out
    assert "note: mean+k-sigma cap" in out


def test_fit_with_prefill_cost_and_multiple_of_rounds_buckets(trace_path, capsys):
    argv = ["buckets", "fit", "--trace", str(trace_path), "--budget", "4", "--cost", "prefill", "--multiple-of", "16"]
    assert _run(argv) == 0
    fitted_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("fitted"))
    assert "cost prefill" in fitted_line
    assert all(int(b) % 16 == 0 for b in fitted_line.split(":", 1)[1].split(","))


def test_fit_writes_plot(trace_path, tmp_path, capsys):
    plot = tmp_path / "buckets.png"
    assert _run(["buckets", "fit", "--trace", str(trace_path), "--budget", "4", "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty file"),
        ("TIMESTAMP,ContextTokens\n1,2\n", "missing column"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,0,1\n", ":2: ContextTokens='0'"),
    ],
)
def test_fit_reports_bad_trace_in_one_line_and_returns_2(tmp_path, capsys, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    assert _run(["buckets", "fit", "--trace", str(path), "--budget", "4"]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "Traceback" not in captured.err and captured.out == ""


def test_fit_reports_missing_file_and_returns_2(tmp_path, capsys):
    assert _run(["buckets", "fit", "--trace", str(tmp_path / "absent.csv"), "--budget", "4"]) == 2
    assert "No such file" in capsys.readouterr().err


def test_fit_rejects_non_positive_budget(trace_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _run(["buckets", "fit", "--trace", str(trace_path), "--budget", "0"])
    assert exit_info.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_fit_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _run(["buckets", "fit", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--trace", "--budget", "--column", "--cost", "--plot", "--multiple-of", "example:"):
        assert option in out


def test_format_table_shows_percentages():
    table = format_table([padding_metrics(FixedList((4, 8)), [1, 4, 5, 8])])
    assert "fixed" in table and "25.0%" in table
