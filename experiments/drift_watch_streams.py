"""Does the refit's drift watch refit a stream whose sizes never changed, and how soon and how well does it follow a shift?

Host only, no model, about five minutes. Each stream feeds `batch/refit.DriftWatch` one single-row prefill step per
size (what the watch reads of a plan), its table swapped in at once when it proposes one (a real job swaps it a
compile later). Three judges: the watch as it ships (the two-sample test, then the saving of a table fitted to
the rows after the change point, at one standard error, every prefill step, and the settle 256 rows after a
drift's swap); the watch until 65bb71f (`HalvesWatch`: the saving of a table fitted to the window's older half
on its newer half, every 4 prefill steps, no settle); and the judge before the two-sample test (the halves'
saving alone at three standard errors: `alpha=2.0, z=3.0`). The saving alone at one standard error refitted 267
of the 480 stationary streams (results at df19635).

1. Stationary: --steps (2,000) sizes from the very log-normal distribution the table was fitted to (5,000 draws;
   5 buckets, multiples of 16, then the 512 top, as tests/batch/test_refit.py), means 20 to 150 tokens, sigmas 0.6
   to 1.2, --seeds (20) each from seed 5000 (the tests use others). Every proposal is a false refit.
2. Shifts: 1,000 sizes of one mean (sigma 0.35) then 1,000 of another, the table fitted to the first; the prefill
   step of the first proposal after the shift (None: never), 10 seeds each from seed 100, and the padding of the
   rows after the shift (on the table in force at each) less that of the table fitted to them alone
   (`refit_chunk_table`), in points, the seeds' mean.
3. Small changes: 1,000 sizes of one distribution then 3,000 of a near one (means 25 to 30 and to 35, 60 to 70 at
   sigma 0.8; 25 to 30 at 1.0; 40 to 50 at 0.6), 20 seeds each from seed 900, too small for a table fitted to the
   new sizes to save much: the refits after the change, and the padding of its rows less the table kept's, in
   points. After a change the watch leaves alone, its sample before the window mixes both distributions, so the
   two-sample test passes on every window for a while and only the saving guards.

    .venv/bin/python experiments/drift_watch_streams.py [--seeds 20] [--steps 2000]
"""

import itertools
from collections.abc import Callable

import numpy as np

from common import paths, report
from jaxinfer.batch.refit import DriftWatch, ks_pvalue, padded_slots, padding, refit_chunk_table, significant_saving
from jaxinfer.bucketing.strategies import fit_buckets
from jaxinfer.scheduling.bucket_tables import cut_table

RESULTS = paths.RESULTS_DIR / "drift_watch_streams.json"
TOP = 512
MEANS, SIGMAS = (20, 25, 30, 40, 60, 150), (0.6, 0.8, 1.0, 1.2)
SHIFTS = ((60, 300), (25, 300), (25, 60), (60, 120), (150, 60), (300, 60))
SMALL_CHANGES = ((25, 30, 0.8), (25, 35, 0.8), (60, 70, 0.8), (25, 30, 1.0), (40, 50, 0.6))


class HalvesWatch(DriftWatch):
    """The watch until 65bb71f: a table fitted to the window's older half, its saving tested on the newer half and
    the newer half's table proposed; judged every 4 prefill steps, no settle."""

    def __init__(self, table: tuple[int, ...], **fields):
        super().__init__(table, every=4, settle_rows=0, **fields)

    def _drift(self) -> tuple[int, ...] | None:
        if self.seen % self.every or len(self.sizes) < self.window or len(self.before) < min(self.window // 2, self.reference):
            return None
        sizes = np.array(self.sizes)
        older, newer = sizes[: sizes.size // 2], sizes[sizes.size // 2 :]
        changed = ks_pvalue(newer, self.before) < self.alpha
        drifted = changed and significant_saving(newer, self.table, refit_chunk_table(older, self.table, self.count), self.threshold, self.z)
        self.strikes = self.strikes + 1 if drifted else 0
        return self._propose(newer, "drift") if self.strikes >= self.strikes_needed else None


JUDGES: dict[str, Callable[[tuple[int, ...]], DriftWatch]] = {
    "watch": lambda table: DriftWatch(table),
    "halves (< 65bb71f)": lambda table: HalvesWatch(table),
    "before the test": lambda table: HalvesWatch(table, alpha=2.0, z=3.0),
}


class _Plan:
    """What the watch reads of a one-row prefill plan: its phase, rows and tokens."""

    phase = "prefill"

    class bucket:  # noqa: N801 (a plan's BucketKey, of which the watch reads the rows)
        num_rows = 1

    def __init__(self, size: int):
        self.num_new_tokens = (size,)


def lengths(rng: np.random.Generator, count: int, mean: float, sigma: float) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(mean), sigma, count).astype(int), 8, 900)


def fitted_table(rng: np.random.Generator, mean: float, sigma: float) -> tuple[int, ...]:
    return cut_table(fit_buckets(np.minimum(lengths(rng, 5000, mean, sigma), TOP - 1), 5, multiple_of=16), TOP, reach=True)


def proposals(watch: DriftWatch, sizes: np.ndarray, slots: list[int] | None = None) -> list[int]:
    """The steps at which the watch proposed a table (each swapped in at once); each size's slots on the table in
    force at its step appended to `slots`."""
    steps = []
    for step, size in enumerate(np.minimum(sizes, TOP)):
        if slots is not None:
            slots.append(int(padded_slots(np.array([size]), watch.table)[0]))
        new = watch.observe(_Plan(int(size)))
        if new is not None:
            steps.append(step)
            watch.reset(new)
    return steps


def stationary(make: Callable, seeds: int, steps: int) -> list[dict]:
    """The false refits of one judge: a row per stream that refitted."""
    refitted = []
    for mean, sigma, seed in itertools.product(MEANS, SIGMAS, range(5000, 5000 + seeds)):
        rng = np.random.default_rng(seed)
        table = fitted_table(rng, mean, sigma)
        if found := proposals(make(table), lengths(rng, steps, mean, sigma)):
            refitted.append({"mean": mean, "sigma": sigma, "seed": seed, "steps": found})
    return refitted


def shifted(make: Callable) -> dict[str, dict]:
    """Per shift, the prefill steps after it of each seed's first proposal, and the padding gap after it."""
    seen = {}
    for before, after in SHIFTS:
        firsts, gaps = [], []
        for seed in range(100, 110):
            rng = np.random.default_rng(seed)
            sizes = np.minimum(np.concatenate([lengths(rng, 1000, before, 0.35), lengths(rng, 1000, after, 0.35)]), TOP)
            table, slots = fitted_table(rng, before, 0.35), []
            found = proposals(make(table), sizes, slots)
            firsts.append(found[0] - 1000 if found else None)
            gaps.append(1 - sizes[1000:].sum() / sum(slots[1000:]) - padding(sizes[1000:], refit_chunk_table(sizes[1000:], table)))
        seen[f"{before}->{after}"] = {"first_proposal": firsts, "padding_gap_points": round(100 * float(np.mean(gaps)), 2)}
    return seen


def small_changes(make: Callable) -> dict[str, dict]:
    """Per small change, the refits after it in 20 streams, and the padding of its rows less the table kept's."""
    seen = {}
    for before, after, sigma in SMALL_CHANGES:
        refits, gaps = 0, []
        for seed in range(900, 920):
            rng = np.random.default_rng(seed)
            sizes = np.minimum(np.concatenate([lengths(rng, 1000, before, sigma), lengths(rng, 3000, after, sigma)]), TOP)
            table, slots = fitted_table(rng, before, sigma), []
            refits += len(proposals(make(table), sizes, slots))
            gaps.append(1 - sizes[1000:].sum() / sum(slots[1000:]) - padding(sizes[1000:], table))
        seen[f"{before}->{after}, sigma {sigma}"] = {"refits": refits, "padding_over_kept_points": round(100 * float(np.mean(gaps)), 2)}
    return seen


def main() -> None:
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--seeds", type=int, default=20, help="seeds per stationary distribution (default 20)")
    parser.add_argument("--steps", type=int, default=2000, help="prefill steps per stationary stream (default 2000)")
    args = parser.parse_args()
    streams = len(MEANS) * len(SIGMAS) * args.seeds
    result = {}
    for name, make in JUDGES.items():
        report.log("drift_watch_streams", f"{name}: {streams} stationary streams, {len(SHIFTS) * 10} shifted")
        result[name] = {"false_refits": stationary(make, args.seeds, args.steps), "shifts": shifted(make), "small_changes": small_changes(make)}
    rows = [[name, streams, len(r["false_refits"]), sum(len(f["steps"]) for f in r["false_refits"])] for name, r in result.items()]
    print(report.format_table([("judge", "<20"), ("streams", ">8d"), ("refitted", ">9d"), ("refits", ">7d")], rows))
    print("\nshifts: padding gap after the shift (points, mean of 10 seeds); first proposal, prefill steps after it (- never):")
    for shift in SHIFTS:
        for name in JUDGES:
            seen = result[name]["shifts"][f"{shift[0]}->{shift[1]}"]
            print(f"  {shift[0]:>3} -> {shift[1]:<4} {name:<20} {seen['padding_gap_points']:6.2f}   " + " ".join("-" if s is None else str(s) for s in seen["first_proposal"]))
    print("\nsmall changes: refits in 20 streams, padding after the change less the table kept's (points):")
    for change in result["watch"]["small_changes"]:
        print(f"  {change:<22} " + "   ".join(f"{name}: {r['small_changes'][change]['refits']}, {r['small_changes'][change]['padding_over_kept_points']:+.2f}"
                                             for name, r in result.items()))
    doc = {"question": __doc__.split("\n\n")[0].replace("\n", " "), "settings": {k: str(v) for k, v in vars(args).items()}, "streams": streams, "result": result}
    report.finish(args.out, doc, {"bench": "drift_watch_streams", "streams": streams, "false_refits": {n: len(r["false_refits"]) for n, r in result.items()},
                                  "padding_gap_points": {n: {k: v["padding_gap_points"] for k, v in r["shifts"].items()} for n, r in result.items()}})


if __name__ == "__main__":
    main()
