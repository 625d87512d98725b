"""Trace reading (Azure format), its error messages, and the synthetic generator."""

import os
import pathlib

import numpy as np
import pytest

from jaxinfer.bucketing.traces import (
    CONVERSATION_TRACE, TRACE_DIR_ENV, Trace, TraceError, load_trace, save_trace, shared_trace, synthetic_trace,
)
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _write(tmp_path, text: str) -> pathlib.Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_load_trace_reads_azure_rows_in_seconds(tmp_path):
    path = _write(
        tmp_path,
        HEADER + "2023-11-16 18:15:46.5000000,374,44\n2023-11-16 18:15:48.0000000,396,109\n\n",
    )
    trace = load_trace(path)
    assert trace.timestamps.tolist() == [0.0, 1.5]
    assert trace.context_tokens.tolist() == [374, 396]
    assert trace.generated_tokens.tolist() == [44, 109]


def test_load_trace_accepts_numeric_timestamps_and_extra_columns(tmp_path):
    path = _write(tmp_path, "Id,TIMESTAMP,ContextTokens,GeneratedTokens\na,10.0,5,0\nb,12.5,7,3\n")
    trace = load_trace(path)
    assert trace.timestamps.tolist() == [0.0, 2.5] and trace.generated_tokens.tolist() == [0, 3]


def test_load_trace_names_missing_column(tmp_path):
    with pytest.raises(TraceError, match="missing column GeneratedTokens"):
        load_trace(_write(tmp_path, "TIMESTAMP,ContextTokens\n1,2\n"))


def test_load_trace_rejects_empty_file(tmp_path):
    with pytest.raises(TraceError, match="empty file"):
        load_trace(_write(tmp_path, ""))


def test_load_trace_rejects_header_without_rows(tmp_path):
    with pytest.raises(TraceError, match="no requests"):
        load_trace(_write(tmp_path, HEADER))


def test_load_trace_names_line_of_non_numeric_length(tmp_path):
    path = _write(tmp_path, HEADER + "0,5,5\n1,abc,5\n")
    with pytest.raises(TraceError, match=r"trace.csv:3: ContextTokens='abc' is not a number"):
        load_trace(path)


def test_load_trace_names_the_file_and_line_of_bytes_that_are_not_utf8(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_bytes(HEADER.encode() + b"0,5,5\n1,6,5\n" + b"2,7\xff,5\n" + b"3,8,5\n" * 5000)  # past the first block read
    with pytest.raises(TraceError, match=r"trace.csv:4: not UTF-8 text"):
        load_trace(path)


@pytest.mark.parametrize("value", ["0", "-4"])
def test_load_trace_names_line_of_non_positive_length(tmp_path, value):
    path = _write(tmp_path, HEADER + f"0,5,5\n1,6,5\n2,{value},5\n")
    with pytest.raises(TraceError, match=rf"trace.csv:4: ContextTokens='{value}' is zero or negative"):
        load_trace(path)


def test_load_trace_rejects_fractional_length(tmp_path):
    with pytest.raises(TraceError, match=r":2: ContextTokens='2.5' is not a whole number"):
        load_trace(_write(tmp_path, HEADER + "0,2.5,5\n"))


@pytest.mark.parametrize("value", ["nan", "inf", "NaT"])
def test_load_trace_names_a_timestamp_that_is_not_a_time(tmp_path, value):
    # one such row made every arrival NaN (seconds since the first)
    with pytest.raises(TraceError, match=rf"trace.csv:3: TIMESTAMP='{value}' is not a time"):
        load_trace(_write(tmp_path, HEADER + f"0,5,5\n{value},6,5\n"))


def test_load_trace_names_a_count_past_what_a_float_holds_exactly(tmp_path):
    with pytest.raises(TraceError, match=r"trace.csv:2: ContextTokens='1e19' is not a whole number of tokens below 2\*\*53"):
        load_trace(_write(tmp_path, HEADER + "0,1e19,5\n"))


def test_load_trace_reads_a_header_after_a_byte_order_mark_or_blank_lines(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_bytes(b"\xef\xbb\xbf\n\n" + (HEADER + "0,5,7\n1,6,8\n").encode())  # a spreadsheet's "CSV UTF-8"
    trace = load_trace(path)
    assert trace.context_tokens.tolist() == [5, 6] and trace.timestamps.tolist() == [0.0, 1.0]


def test_load_trace_allows_zero_in_other_column_but_not_negative(tmp_path):
    assert load_trace(_write(tmp_path, HEADER + "0,5,0\n")).generated_tokens.tolist() == [0]
    with pytest.raises(TraceError, match=r":2: GeneratedTokens='-1' is negative"):
        load_trace(_write(tmp_path, HEADER + "0,5,-1\n"))
    with pytest.raises(TraceError, match=r":2: GeneratedTokens='0' is zero or negative"):
        load_trace(_write(tmp_path, HEADER + "0,5,0\n"), column="GeneratedTokens")


def test_load_trace_names_line_of_bad_timestamp_or_short_row(tmp_path):
    with pytest.raises(TraceError, match=r":2: TIMESTAMP='yesterday' is not a time"):
        load_trace(_write(tmp_path, HEADER + "yesterday,5,5\n"))
    with pytest.raises(TraceError, match=r":3: expected at least 3 fields, got 2"):
        load_trace(_write(tmp_path, HEADER + "0,5,5\n1,5\n"))


def test_load_trace_raises_file_not_found_for_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "absent.csv")


def test_save_then_load_round_trips_synthetic_trace(tmp_path):
    trace = synthetic_trace(200, seed=3, arrival="bursty")
    save_trace(trace, tmp_path / "out.csv")
    loaded = load_trace(tmp_path / "out.csv")
    np.testing.assert_allclose(loaded.timestamps, trace.timestamps, atol=1e-6)
    assert np.array_equal(loaded.context_tokens, trace.context_tokens)
    assert np.array_equal(loaded.generated_tokens, trace.generated_tokens)


def test_synthetic_trace_is_reproducible_for_a_seed():
    first, again, other = synthetic_trace(500, seed=1), synthetic_trace(500, seed=1), synthetic_trace(500, seed=2)
    assert np.array_equal(first.context_tokens, again.context_tokens)
    assert np.array_equal(first.timestamps, again.timestamps)
    assert not np.array_equal(first.context_tokens, other.context_tokens)


def test_synthetic_trace_defaults_match_conversation_fit():
    trace = synthetic_trace(40_000, seed=0, max_length=None)
    for lengths, log_mean, log_sd in ((trace.context_tokens, 6.63, 0.99), (trace.generated_tokens, 5.02, 0.86)):
        assert np.log(lengths).mean() == pytest.approx(log_mean, abs=0.02)
        assert np.log(lengths).std() == pytest.approx(log_sd, abs=0.02)
    assert trace.num_requests / trace.timestamps[-1] == pytest.approx(5.5, rel=0.03)


def test_synthetic_trace_bursty_arrivals_have_higher_gap_variation_at_same_rate():
    poisson = np.diff(synthetic_trace(20_000, seed=0, arrival="poisson").timestamps)
    bursty = np.diff(synthetic_trace(20_000, seed=0, arrival="bursty", burstiness=4.0).timestamps)
    assert bursty.mean() == pytest.approx(poisson.mean(), rel=0.05)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.15)
    assert (poisson.std() / poisson.mean()) ** 2 == pytest.approx(1.0, rel=0.1)


def test_synthetic_trace_clips_to_max_length():
    trace = synthetic_trace(5000, seed=0, input_log_mean=9.0, max_length=4096)
    assert trace.context_tokens.max() == 4096 and trace.context_tokens.min() >= 1


def test_split_in_time_orders_by_timestamp():
    trace = Trace(np.array([3.0, 1.0, 2.0, 0.0]), np.array([30, 10, 20, 5]), np.array([1, 1, 1, 1]))
    earlier, later = trace.split_in_time(0.5)
    assert earlier.context_tokens.tolist() == [5, 10] and later.context_tokens.tolist() == [20, 30]


def test_trace_arrays_are_read_only():
    trace = synthetic_trace(10, seed=0)
    with pytest.raises(ValueError):
        trace.context_tokens[0] = 1


def _conversation_trace() -> pathlib.Path:
    """The shared conversation trace. Skips when $JAXINFER_TRACE_DIR is unset or lacks the file; under CI=true
    a variable that is set but names a folder without the file fails instead (a broken setup, not an absence)."""
    try:
        return shared_trace(CONVERSATION_TRACE)
    except TraceError as error:
        if os.environ.get(TRACE_DIR_ENV) and os.environ.get("CI") == "true":
            pytest.fail(f"{TRACE_DIR_ENV} is set but the conversation trace is not there: {error}")
        pytest.skip(f"the conversation trace is not available: {error}")


def test_shared_trace_names_the_variable_when_unset(monkeypatch):
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    with pytest.raises(TraceError, match=f"{TRACE_DIR_ENV} is not set"):
        shared_trace("any.csv")


def test_shared_trace_names_the_variable_and_file_when_missing(monkeypatch, tmp_path):
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    with pytest.raises(TraceError, match=rf"absent\.csv.*{TRACE_DIR_ENV}="):
        shared_trace("absent.csv")


def test_shared_trace_finds_the_file_in_the_folder(monkeypatch, tmp_path):
    (tmp_path / "t.csv").write_text(HEADER + "0,1,1\n")
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    assert shared_trace("t.csv") == tmp_path / "t.csv"
    assert load_trace(shared_trace("t.csv")).num_requests == 1


def test_load_trace_reads_conversation_trace():
    trace = load_trace(_conversation_trace())
    assert trace.num_requests == 19_366
    assert trace.context_tokens.min() >= 1 and trace.timestamps[-1] == pytest.approx(3501.72, abs=0.01)
