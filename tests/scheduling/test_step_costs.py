"""The step-cost table: capped means of recent runs, estimates for keys never measured, the host line, JSON. Host only."""

import json

import pytest

from jaxinfer.scheduling.plan import BucketKey
from jaxinfer.scheduling.step_costs import CAP, DEFAULT_STEP_S, KEEP, MAX_HOST_GAP_S, StepCosts, work

PREFILL = BucketKey("prefill", 1, 64, 4)
DECODE = BucketKey("decode", 4, 1, 4)


def test_a_measured_key_costs_the_mean_of_its_recent_runs_a_stall_counted_at_most_cap_times_their_median():
    costs = StepCosts()
    for seconds in (0.30, 0.10, 0.20, 5.0, 0.25):  # median 0.25, so the 5 s stall counts as CAP x 0.25
        costs.observe(PREFILL, seconds)
    assert costs.device_seconds(PREFILL) == pytest.approx((0.30 + 0.10 + 0.20 + CAP * 0.25 + 0.25) / 5)
    for _ in range(KEEP):  # only the most recent KEEP runs count
        costs.observe(PREFILL, 0.5)
    assert costs.device_seconds(PREFILL) == pytest.approx(0.5)
    assert costs.programs[PREFILL].count == 5 + KEEP
    costs.observe(DECODE, 0.05, warmup=True)
    costs.observe(DECODE, 5.0, warmup=True)  # two warm-up runs, one a stall: capped at CAP x the faster, not at their mean
    assert costs.device_seconds(DECODE) == pytest.approx((0.05 + CAP * 0.05) / 2)


def test_a_key_whose_steps_come_in_two_sizes_is_priced_at_what_they_sum_to_not_its_median():
    """A program's steps after another program's run slower than after its own: 3 of 8 at 1.4x. The simulator
    adds a key's price once per step, so only the mean makes the sum of 8 steps right."""
    costs = StepCosts()
    steps = [0.10] * 5 + [0.14] * 3
    for seconds in steps:
        costs.observe(DECODE, seconds)
    assert 8 * costs.device_seconds(DECODE) == pytest.approx(sum(steps))
    assert costs.programs[DECODE].median == pytest.approx(0.10)  # 8 x the median would be 12% short


def test_an_unmeasured_key_is_estimated_on_the_line_through_its_phases_measured_keys():
    costs = StepCosts()
    small, large = BucketKey("decode", 4, 1, 4), BucketKey("decode", 8, 1, 4)  # work 20 and 40
    costs.observe(small, 0.030)
    costs.observe(large, 0.050)
    # line through (20, 0.030) and (40, 0.050): 0.010 + 0.001 * work
    middle = BucketKey("decode", 4, 1, 11)  # work 4 * 12 = 48
    assert work(middle) == 48
    assert costs.device_seconds(middle) == pytest.approx(0.010 + 0.001 * 48)
    # a phase with nothing measured falls back to every measured key; an empty table to the default
    assert costs.device_seconds(BucketKey("prefill", 1, 16, 4)) == pytest.approx(0.010 + 0.001 * 20)
    assert StepCosts().device_seconds(PREFILL) == DEFAULT_STEP_S


def test_the_host_line_goes_through_the_median_gap_of_each_row_count():
    costs = StepCosts()
    for gap in (0.011, 0.012, 0.013, 0.4):  # rows 1: median 0.0125
        costs.observe_host(1, gap)
    for gap in (0.031, 0.032, 0.033):  # rows 3: median 0.032
        costs.observe_host(3, gap)
    costs.observe_host(3, MAX_HOST_GAP_S * 2)  # a wait, not host work: ignored
    intercept, slope = costs.host.line
    assert slope == pytest.approx((0.032 - 0.0125) / 2)
    assert intercept == pytest.approx(0.0125 - slope)
    costs.observe(DECODE, 0.1)
    assert costs.step_seconds(DECODE, 2) == pytest.approx(0.1 + intercept + 2 * slope)
    assert StepCosts().host_seconds(8) == 0.0


def test_the_table_round_trips_through_json():
    costs = StepCosts()
    costs.observe(PREFILL, 0.2)
    costs.observe(PREFILL, 0.4)
    costs.observe(DECODE, 0.05)
    costs.observe_host(4, 0.002)
    again = StepCosts.from_json(json.loads(json.dumps(costs.to_json())))
    assert again.table() == costs.table()
    assert again.host.line == costs.host.line
    assert again.device_seconds(BucketKey("decode", 8, 1, 8)) == costs.device_seconds(BucketKey("decode", 8, 1, 8))


@pytest.mark.parametrize(("doc", "needle"), [
    ({"format": "other"}, "not a step-cost table"),
    ({"format": "jaxinfer-step-costs/1", "programs": [{"key": ["train", 1, 1, 1], "count": 1, "recent": [0.1]}]}, "programs[0].key"),
    ({"format": "jaxinfer-step-costs/1", "programs": [{"key": ["decode", 1, 1, 1], "count": 1, "recent": [-1.0]}]}, "programs[0].recent"),
    ({"format": "jaxinfer-step-costs/1", "programs": [{"key": ["decode", 1, 1, 1], "count": 0, "recent": [0.1]}]}, "programs[0].count"),
    ({"format": "jaxinfer-step-costs/1", "host": [{"rows": "2", "count": 1, "recent": [0.1]}]}, "host[0].rows"),
    ({"format": "jaxinfer-step-costs/1", "host": [{"rows": 1, "count": 0, "recent": [], "warmup": [0.001]}]}, "host[0].recent must hold seconds"),
    ({"format": "jaxinfer-step-costs/1", "programs": {"a": 1}}, "programs must be a list of objects"),
    ({"format": "jaxinfer-step-costs/1", "programs": [["decode", 1, 1, 1]]}, "programs must be a list of objects"),
    ({"format": "jaxinfer-step-costs/1", "programs": None}, "programs must be a list of objects"),
    ({"format": "jaxinfer-step-costs/1", "host": [3]}, "host must be a list of objects"),
])
def test_a_bad_document_is_refused_naming_the_field(doc, needle):
    with pytest.raises(ValueError, match=__import__("re").escape(needle)):
        StepCosts.from_json(doc)


def test_a_negative_or_nan_step_time_is_refused():
    with pytest.raises(ValueError, match="finite"):
        StepCosts().observe(DECODE, float("nan"))


def test_warm_up_runs_count_until_real_runs_come_and_are_scaled_by_the_phases_real_to_warm_up_ratio():
    costs = StepCosts()
    both, only_warm = BucketKey("prefill", 1, 64, 4), BucketKey("prefill", 1, 128, 8)
    costs.observe(both, 0.10, warmup=True)
    costs.observe(only_warm, 0.20, warmup=True)
    assert costs.device_seconds(both) == pytest.approx(0.10)
    costs.observe(both, 0.15)  # real rows run 1.5x the padding plan
    assert costs.device_seconds(both) == pytest.approx(0.15)  # real runs replace the warm-up ones
    assert costs.device_seconds(only_warm) == pytest.approx(0.20 * 1.5)
    assert costs.programs[both].count == 1  # warm-up runs are not counted as runs
    again = StepCosts.from_json(json.loads(json.dumps(costs.to_json())))
    assert again.device_seconds(only_warm) == pytest.approx(0.30)
    stalled = StepCosts()  # two warm-up runs, one a stall: the ratio's warm-up side is their capped price, as only_warm's is
    stalled.observe(both, 0.10, warmup=True)
    stalled.observe(both, 5.0, warmup=True)
    stalled.observe(both, 0.20)
    stalled.observe(only_warm, 0.20, warmup=True)
    assert stalled.device_seconds(only_warm) == pytest.approx(0.20 * 0.20 / ((0.10 + CAP * 0.10) / 2))


def _noisy_prefill_and_decode(seed: int) -> StepCosts:
    """Costs linear in work (intercept 20 ms, 0.5 ms a slot) times noise of a loaded machine (x0.3 to x3)."""
    import numpy as np

    rng, costs = np.random.default_rng(seed), StepCosts()
    for tokens in range(16, 257, 16):
        for pages in (2, 4, 8, 16):
            costs.observe(BucketKey("prefill", 1, tokens, pages), (0.02 + 0.0005 * (tokens + pages)) * rng.uniform(0.3, 3.0))
    for rows in (1, 2, 4, 8):
        for pages in (2, 4, 8, 16):
            costs.observe(BucketKey("decode", rows, 1, pages), (0.02 + 0.0005 * rows * (1 + pages)) * rng.uniform(0.3, 3.0))
    return costs


def test_the_monotone_view_never_prices_a_wider_key_below_a_narrower_one():
    raw = _noisy_prefill_and_decode(0)
    view = raw.monotone()
    keys = [BucketKey("prefill", 1, t, p) for t in range(8, 300, 8) for p in (1, 2, 3, 4, 8, 12, 16, 20)]
    keys += [BucketKey("decode", r, 1, p) for r in (1, 2, 3, 4, 6, 8, 12) for p in (1, 2, 4, 6, 8, 16, 20)]

    def violations(costs):
        return sum(costs.device_seconds(a) > costs.device_seconds(b) for a in keys for b in keys
                   if a.phase == b.phase and a.num_rows <= b.num_rows and a.num_tokens <= b.num_tokens and a.num_pages <= b.num_pages)

    assert violations(raw) > 0  # the noisy medians disagree with each other
    assert violations(view) == 0
    with pytest.raises(TypeError, match="read-only"):
        view.observe(DECODE, 0.1)
    assert view.monotone() is view and view.host is raw.host


def test_the_monotone_view_prices_every_key_on_its_phases_line_through_the_measured_medians():
    costs = StepCosts()
    small, middle, large = BucketKey("prefill", 1, 32, 1), BucketKey("prefill", 1, 64, 1), BucketKey("prefill", 1, 128, 1)
    other = BucketKey("prefill", 1, 64, 8)
    for key, seconds in ((small, 0.10), (middle, 0.30), (large, 0.20), (other, 0.50), (DECODE, 9.0)):
        costs.observe(key, seconds)
    # the least-squares line through (work 33, 0.10), (65, 0.30), (129, 0.20), (72, 0.50), by hand; decode is apart
    xs, ys = [33, 65, 129, 72], [0.10, 0.30, 0.20, 0.50]
    mx, my = sum(xs) / 4, sum(ys) / 4
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    view = costs.monotone()
    for key in (small, middle, large, other, BucketKey("prefill", 1, 96, 4)):
        assert view.device_seconds(key) == pytest.approx(my + slope * (work(key) - mx))
    assert costs.device_seconds(large) == pytest.approx(0.20)  # the source keeps its medians
    assert view.device_seconds(large) > view.device_seconds(middle)  # where the medians had large < middle


def test_a_linear_table_prices_each_program_by_its_work_and_the_host_by_its_rows():
    """Hand-computed: decode 4 rows x 4 pages is work 20, prefill 64 tokens x 4 pages work 68."""
    costs = StepCosts.linear([PREFILL, DECODE], program=(0.002, 0.001), host=(0.0005, 0.0001), max_rows=8)
    assert work(DECODE) == 20 and work(PREFILL) == 68
    assert costs.device_seconds(DECODE) == pytest.approx(0.022) and costs.device_seconds(PREFILL) == pytest.approx(0.070)
    assert costs.host_seconds(1) == pytest.approx(0.0006) and costs.host_seconds(8) == pytest.approx(0.0013)
    assert costs.host_seconds(4) == pytest.approx(0.0009)  # on the line through the two row counts


def test_a_cached_table_fills_only_what_this_table_has_not_measured():
    mine, cached = StepCosts(), StepCosts()
    mine.observe(DECODE, 0.010)
    mine.observe_host(1, 0.001)
    cached.observe(DECODE, 0.050)
    cached.observe(BucketKey("decode", 8, 1, 8), 0.020)
    cached.observe_host(1, 0.009)
    cached.observe_host(4, 0.004)
    same = mine
    mine.fill_from(cached)
    assert mine is same and mine.programs[DECODE].recent == [0.010]  # its own runs win
    assert mine.device_seconds(BucketKey("decode", 8, 1, 8)) == pytest.approx(0.020)
    assert mine.host.by_rows[1].recent == [0.001] and mine.host.by_rows[4].recent == [0.004]
    assert mine.host.line == pytest.approx((0.0, 0.001), abs=1e-12)  # through (1, 0.001) and (4, 0.004): refitted after the fill
