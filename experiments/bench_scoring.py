"""Is LLM.score at eval speed: 8 continuations of one 500-token context against 8 prompt-logprob requests?

SmolLM2-135M-Instruct (f32) on this CPU. The context is --context-tokens of the real-text passages
(experiments/data), the 8 continuations the passage's next spans of 4 to 18 tokens. Runs, each from an empty
prefix cache (LLM.reset_prefix_cache), best of --repeats:
  score        LLM.score(context, continuations): the context prefilled once, then the 8 pairs from its
               cached pages, logits only from logprob_start (the context's last token) on;
  requests_off 8 requests context + continuation with prompt_logprobs=1 and max_tokens=1 (what scoring
               was before: the whole prompt scored), prefix cache off;
  requests_on  the same, prefix cache on;
  start_on     (for reference) 8 requests with the new logprob_start and max_tokens=0, prefix cache on,
               all submitted at once (no context-first ordering).
Correctness first: every continuation's token log-probabilities from score equal requests_off's within 1e-4.
The context's prefills are counted from the steps' positions (each context position of a full page computed
once means one prefill). Writes experiments/results/bench_scoring.json; the last stdout line is one JSON document.

    .venv/bin/python experiments/bench_scoring.py [--context-tokens 500] [--repeats 3] [--quick]
"""

import json
import time

import numpy as np

from common import engine_runs, paths, report, timing, workloads
from common.paths import REPO_ROOT
from jaxinfer.api import LLM
from jaxinfer.scheduling.request import SamplingParams

RESULTS = paths.RESULTS_DIR / "bench_scoring.json"
WORK_DIR = REPO_ROOT / "build" / "bench_scoring"
NUM_CONTINUATIONS = 8
GOALS = {"speedup_vs_off": ("score >= 4x faster than 8 prompt-logprob requests, prefix cache off", 4.0, "at_least"),
         "speedup_vs_on": ("score >= 1.5x faster than 8 prompt-logprob requests, prefix cache on", 1.5, "at_least"),
         "context_prefills": ("the context is prefilled once", 1.0, "at_most"),
         "max_abs_diff": ("score's token log-probabilities equal the requests' within 1e-4", 1e-4, "at_most")}


def parse_args():
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--context-tokens", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (best kept)")
    parser.add_argument("--quick", action="store_true", help="one repeat, a 200-token context (a smoke run, not a measurement)")
    args = parser.parse_args()
    if args.quick:  # written beside the build, so a smoke run never replaces the measured result
        args.repeats, args.context_tokens, args.out = 1, 200, WORK_DIR / "quick.json"
    return args


def make_llm(**fields) -> LLM:
    cfg = engine_runs.workload_engine_config(max_num_seqs=NUM_CONTINUATIONS, compilation_cache_dir=str(WORK_DIR / "xla_cache"), **fields)
    llm, seconds = timing.timed(LLM, None, dtype="float32", engine_config=cfg)
    report.log("bench_scoring", f"{fields or 'prefix cache on'}: loaded and compiled {llm.engine.num_compilations} programs in {seconds:.1f}s")
    return llm


class StepCounter:
    """on_step hook: steps, real tokens and how often each position was computed."""

    def __init__(self):
        self.steps, self.tokens, self.positions = 0, 0, {}

    def __call__(self, plan, tokens, seconds) -> None:
        self.steps += 1
        self.tokens += plan.num_real_tokens
        for (row, first), length in zip(plan.chunk_starts(), plan.num_new_tokens):
            for position in plan.positions[row, first : first + length].tolist():
                self.positions[position] = self.positions.get(position, 0) + 1


def run_score(llm: LLM, context: list[int], continuations: list[list[int]]):
    counter = StepCounter()
    llm.reset_prefix_cache()
    results, seconds = timing.timed(llm.score, context, continuations, on_step=counter)
    return [r.token_logprobs for r in results], seconds, counter


def run_requests(llm: LLM, context: list[int], continuations: list[list[int]], *, start: bool):
    """8 prompt-logprob requests at once: the whole prompt scored (max_tokens=1), or from logprob_start (max_tokens=0)."""
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1, logprob_start=len(context)) if start else SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    counter = StepCounter()
    llm.reset_prefix_cache()
    outputs, seconds = timing.timed(llm.generate, [context + c for c in continuations], params, on_step=counter, progress=False)
    return [[lp for lp, _ in o.prompt_logprobs[len(context):]] for o in outputs], seconds, counter


def best_of(repeats: int, run) -> dict:
    """The fastest of `repeats` runs: its seconds, steps and tokens, and its log-probabilities."""
    runs = [run() for _ in range(repeats)]
    logprobs, seconds, counter = min(runs, key=lambda r: r[1])
    return {"seconds": seconds, "all_seconds": [r[1] for r in runs], "steps": counter.steps, "tokens_computed": counter.tokens,
            "positions": counter.positions, "logprobs": logprobs}


def main() -> None:
    args = parse_args()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    cached = make_llm()
    text = workloads.text_ids(cached.tokenizer)
    context = text[: args.context_tokens]
    continuations = [text[args.context_tokens + 20 * i : args.context_tokens + 20 * i + 4 + 2 * i] for i in range(NUM_CONTINUATIONS)]
    start = time.perf_counter()
    runs = {"score": best_of(args.repeats, lambda: run_score(cached, context, continuations)),
            "requests_on": best_of(args.repeats, lambda: run_requests(cached, context, continuations, start=False)),
            "start_on": best_of(args.repeats, lambda: run_requests(cached, context, continuations, start=True))}
    uncached = make_llm(enable_prefix_caching=False)
    runs["requests_off"] = best_of(args.repeats, lambda: run_requests(uncached, context, continuations, start=False))
    diff = max(float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(runs["score"]["logprobs"], runs["requests_off"]["logprobs"]))
    shared_end = (len(context) - 1) // cached.engine_config.page_size * cached.engine_config.page_size
    prefills = max(runs["score"]["positions"].get(p, 0) for p in range(shared_end))
    measured = {"speedup_vs_off": runs["requests_off"]["seconds"] / runs["score"]["seconds"],
                "speedup_vs_on": runs["requests_on"]["seconds"] / runs["score"]["seconds"],
                "speedup_vs_start_on": runs["start_on"]["seconds"] / runs["score"]["seconds"], "context_prefills": prefills, "max_abs_diff": diff}
    columns = [("run", "<14"), ("seconds", "9.3f"), ("steps", "6d"), ("tokens", "7d"), ("score faster", "13.2f")]
    print("\n" + report.format_table(columns, [[name, r["seconds"], r["steps"], r["tokens_computed"], r["seconds"] / runs["score"]["seconds"]] for name, r in runs.items()]))
    judged = report.judge(GOALS, measured)
    report.print_goals(judged)
    for run in runs.values():
        run.pop("positions"), run.pop("logprobs")
    doc = {"question": "LLM.score against 8 prompt-logprob requests on one context", "settings": {k: str(v) for k, v in vars(args).items()},
           "context_tokens": len(context), "continuation_tokens": [len(c) for c in continuations], "runs": runs, "measured": measured,
           "goals": judged, "runtime_s": time.perf_counter() - start}
    report.finish(args.out, doc, {"bench": "scoring", "quick": args.quick, **measured}, correct=diff <= 1e-4)


if __name__ == "__main__":
    main()
