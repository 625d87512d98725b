"""`jaxinfer buckets fit`, driven through the parser that `add_subparser` registers."""

import argparse
import inspect
import re

import numpy as np
import pytest

from jaxinfer.bucketing.strategies import CostModel, FixedList, fit_buckets, padding_metrics, strategies_at_budget
from jaxinfer.bucketing.cli import _FIT_DESCRIPTION, _FIT_EPILOG, add_subparser, compare_strategies, cost_model, format_table
from jaxinfer.bucketing.traces import CONTEXT_TOKENS, load_trace, save_trace, synthetic_trace

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


def _fit_parser() -> argparse.ArgumentParser:
    buckets = add_subparser(argparse.ArgumentParser(prog="jaxinfer").add_subparsers(dest="command"))
    commands = next(a for a in buckets._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["fit"]


def _squash(text: str) -> str:
    """Whitespace-insensitive text: argparse re-wraps option help to the terminal width."""
    return " ".join(text.split())


def _default_of(function, name: str):
    return inspect.signature(function).parameters[name].default


def test_fit_help_lists_every_option_with_its_explanation_and_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _run(["buckets", "fit", "--help"])
    assert exit_info.value.code == 0
    out = _squash(capsys.readouterr().out)
    options = [a for a in _fit_parser()._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} == {"trace", "budget", "column", "cost", "crossover", "multiple_of", "plot"}
    for action in options:
        explanation = _squash(action.help % {**vars(action), "prog": "jaxinfer buckets fit"})
        assert f"{action.option_strings[0]} {action.metavar or '{' + ','.join(action.choices) + '}'} {explanation}" in out
        if action.default is not None:
            assert f"(default: {action.default}" in explanation, f"{action.option_strings[0]} hides its default"
    assert _squash(_FIT_DESCRIPTION) in out and _squash(_FIT_EPILOG) in out


def test_fit_help_defaults_equal_the_defaults_of_the_functions_they_describe():
    defaults = {a.dest: a.default for a in _fit_parser()._actions}
    assert defaults["crossover"] == _default_of(cost_model, "crossover_length") == _default_of(CostModel.prefill, "crossover_length")
    assert defaults["multiple_of"] == _default_of(fit_buckets, "multiple_of") == _default_of(compare_strategies, "multiple_of")
    assert cost_model(defaults["cost"]) == _default_of(fit_buckets, "cost") == _default_of(compare_strategies, "cost")
    assert defaults["column"] == _default_of(load_trace, "column") == CONTEXT_TOKENS  # "the prompt"


def test_fit_help_cost_claims_hold():
    """"padded tokens", "a*n + b*n^2", and the crossover: attention (n^2 term) equals matmuls (n term)."""
    lengths = np.array([1, 7, 300])
    np.testing.assert_array_equal(cost_model("tokens")(lengths), lengths)
    prefill = cost_model("prefill", 300)
    assert prefill.linear * 300 == pytest.approx(prefill.quadratic * 300**2)
    np.testing.assert_allclose(prefill(lengths), lengths + lengths**2 / 300)


def test_fit_description_names_exactly_the_strategies_it_compares():
    listed = re.search(r"every other strategy \(([^)]*)\)", _FIT_DESCRIPTION).group(1)
    compared = {strategy.name for strategy in strategies_at_budget([1, 5, 9, 30], 3)} - {"fitted"}
    same_words = lambda name: name.strip().replace("-", " ")  # "powers of two" is "powers-of-two"
    assert set(map(same_words, listed.split(","))) == set(map(same_words, compared))


def test_fit_description_waste_and_over_top_claims_hold():
    """Waste is (padded - real) / padded per request; longer requests are chunked and counted as over top."""
    metrics = padding_metrics(FixedList((4, 8)), [3, 8, 19])  # padded 4, 8 and 8 + 8 + 4
    assert (metrics.padded_tokens, metrics.num_over_top) == (32, 1)
    assert metrics.token_waste == pytest.approx((32 - 30) / 32)


def test_fit_epilog_example_parses_with_the_real_parser():
    command = _FIT_EPILOG.splitlines()[-1].split()
    assert command[:3] == ["jaxinfer", "buckets", "fit"]
    args = _fit_parser().parse_args(command[3:])
    assert (args.trace, args.budget, args.plot) == ("$JAXINFER_TRACE_DIR/azure_llm_trace_2023_conv.csv", 12, "buckets.png")


def test_format_table_shows_percentages():
    table = format_table([padding_metrics(FixedList((4, 8)), [1, 4, 5, 8])])
    assert "fixed" in table and "25.0%" in table
