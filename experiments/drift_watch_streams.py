"""Does the refit's drift watch refit a stream whose sizes never changed, and how soon does it see a real shift?

Host only, no model, about a minute. Each stream feeds `batch/refit.DriftWatch` one single-row prefill step per size
(what the watch reads of a plan), its table swapped in at once when it proposes one (a real job swaps it a compile
later). Two judges: the watch as it ships, and the saving alone (the same watch with every two-sample test passing,
`alpha=2.0`: the judge before the test, which judged from 64 rows, not 96).

1. Stationary: --steps (2,000) sizes from the very log-normal distribution the table was fitted to (5,000 draws;
   5 buckets, multiples of 16, then the 512 top, as tests/batch/test_refit.py), means 20 to 150 tokens, sigmas 0.6
   to 1.2, --seeds (20) each from seed 5000 (seeds none of the tests use). Every proposal is a false refit.
2. Shifts: 1,000 sizes of one mean (sigma 0.35) then 1,000 of another, the table fitted to the first; the prefill
   step of the first proposal after the shift (None: never), 10 seeds each from seed 100.

    .venv/bin/python experiments/drift_watch_streams.py [--seeds 20] [--steps 2000]
"""

import itertools
from collections.abc import Callable

import numpy as np

from common import paths, report
from jaxinfer.batch.refit import DriftWatch
from jaxinfer.bucketing.strategies import fit_buckets
from jaxinfer.scheduling.bucket_tables import cut_table

RESULTS = paths.RESULTS_DIR / "drift_watch_streams.json"
TOP = 512
MEANS, SIGMAS = (20, 25, 30, 40, 60, 150), (0.6, 0.8, 1.0, 1.2)
SHIFTS = ((60, 300), (25, 300), (25, 60), (60, 120), (150, 60), (300, 60))
JUDGES: dict[str, Callable[[tuple[int, ...]], DriftWatch]] = {
    "watch": lambda table: DriftWatch(table),
    "saving alone": lambda table: DriftWatch(table, alpha=2.0),
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


def proposals(watch: DriftWatch, sizes: np.ndarray) -> list[int]:
    """The steps at which the watch proposed a table (each swapped in at once)."""
    steps = []
    for step, size in enumerate(np.minimum(sizes, TOP)):
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


def shifted(make: Callable) -> dict[str, list[int | None]]:
    """Per shift, the prefill steps after it of each seed's first proposal."""
    seen = {}
    for before, after in SHIFTS:
        firsts = []
        for seed in range(100, 110):
            rng = np.random.default_rng(seed)
            sizes = np.concatenate([lengths(rng, 1000, before, 0.35), lengths(rng, 1000, after, 0.35)])
            found = proposals(make(fitted_table(rng, before, 0.35)), sizes)
            firsts.append(found[0] - 1000 if found else None)
        seen[f"{before}->{after}"] = firsts
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
        result[name] = {"false_refits": stationary(make, args.seeds, args.steps), "first_proposal_after_shift": shifted(make)}
    rows = [[name, streams, len(r["false_refits"]), sum(len(f["steps"]) for f in r["false_refits"])] for name, r in result.items()]
    print(report.format_table([("judge", "<14"), ("streams", ">8d"), ("refitted", ">9d"), ("refits", ">7d")], rows))
    print("\nfirst proposal, prefill steps after the shift (10 seeds; - never):")
    for shift in result["watch"]["first_proposal_after_shift"]:
        for name in JUDGES:
            steps = " ".join("-" if s is None else str(s) for s in result[name]["first_proposal_after_shift"][shift])
            print(f"  {shift:<9} {name:<13} {steps}")
    same = all(result["watch"]["first_proposal_after_shift"] == result[name]["first_proposal_after_shift"] for name in JUDGES)
    doc = {"question": __doc__.split("\n\n")[0].replace("\n", " "), "settings": {k: str(v) for k, v in vars(args).items()}, "streams": streams,
           "result": result, "same_shift_proposals": same}
    report.finish(args.out, doc, {"bench": "drift_watch_streams", "streams": streams, "false_refits": {n: len(r["false_refits"]) for n, r in result.items()},
                                  "same_shift_proposals": same})


if __name__ == "__main__":
    main()
