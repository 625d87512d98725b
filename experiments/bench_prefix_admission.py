"""Does prefix-aware admission cut the prefill work of a few-shot batch, with the same outputs?

A 1,000-line file (written under build/bench_prefix_admission/lines.jsonl, one {"prompt": ...} a line, for
`jaxinfer generate --input ... --policy prefix` too): 20 few-shot preambles of about 400 SmolLM2 tokens, each a
task line and worked examples cut from real text (experiments/data: passages.txt and the held-out Python
docs), and after it the line's own passage and "Answer:"; the lines draw their preambles at random and are
shuffled. The default model (`LLM()` with its defaults) runs the file under first-come-first-served and
under the prefix policy: prefill tokens computed (the tokens of prefill steps), prefix-cache hits, steps and
wall time; then both again in deterministic mode, whose outputs must be identical. The scheduler's dry run
(host only, no model) gives the same counts for the file at the engine's pool and at smaller pools.

    .venv/bin/python experiments/bench_prefix_admission.py [--lines 1000] [--preambles 20] [--max-tokens 16] [--quick] [--dry-run-only]
"""

import dataclasses
import gc
import json
import random
import re
import time

from common import paths, report
from common.paths import REPO_ROOT
from jaxinfer.config import EngineConfig
from jaxinfer.loading.tokenizer import load_tokenizer
from jaxinfer.scheduling import runloop

RESULTS = paths.RESULTS_DIR / "bench_prefix_admission.json"
WORK_DIR = REPO_ROOT / "build" / "bench_prefix_admission"
TEXT_FILES = (paths.TEXT_FILE, REPO_ROOT / "experiments" / "data" / "heldout_python_docs.txt")
TASKS = ("Summarise the passage in one sentence.", "Name the main subject of the passage.", "Say whether the passage gives instructions.",
         "Give the passage a short title.", "List one fact the passage states.")
POLICIES = ("fcfs", "prefix")
GOALS = {"prefill_ratio": ("prefix-aware prefill tokens computed <= 1/3 of first-come-first-served's", 1 / 3, "at_most"),
         "speedup": ("prefix-aware wall time >= 1.5x faster than first-come-first-served", 1.5, "at_least"),
         "deterministic_identical": ("deterministic mode: share of outputs identical to first-come-first-served's", 1.0, "at_least")}


def sentences() -> list[str]:
    """The real text's sentences (passages, then the held-out Python docs), whitespace collapsed."""
    text = " ".join(path.read_text() for path in TEXT_FILES)
    return [s for s in (" ".join(part.split()) for part in re.split(r"(?<=[.!?])\s+", text)) if 20 <= len(s) <= 400]


def preambles(tokenizer, pool: list[str], count: int, tokens: int, rng: random.Random) -> list[str]:
    """`count` few-shot preambles of about `tokens` tokens: a numbered task, then example passages with
    answers (the next sentence of the text), until the preamble holds `tokens` tokens."""
    out = []
    for i in range(count):
        text = f"Task {i + 1}: {TASKS[i % len(TASKS)]}\n\n"
        start = rng.randrange(len(pool) - 1)
        for j in range(start, start + len(pool)):
            example = f"Passage: {pool[j % len(pool)]}\nAnswer: {pool[(j + 1) % len(pool)][:120]}\n\n"
            if len(tokenizer.encode(text + example)) > tokens:
                break
            text += example
        out.append(text)
    return out


def build_lines(tokenizer, num_lines: int, num_preambles: int, preamble_tokens: int, seed: int = 0) -> list[str]:
    """The shuffled few-shot lines, written to WORK_DIR/lines.jsonl as {"prompt": ...}."""
    rng = random.Random(seed)
    pool = sentences()
    shots = preambles(tokenizer, pool, num_preambles, preamble_tokens, rng)
    lines = [f"{rng.choice(shots)}Passage: {rng.choice(pool)}\nAnswer:" for _ in range(num_lines)]
    rng.shuffle(lines)
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    (WORK_DIR / "lines.jsonl").write_text("".join(json.dumps({"prompt": line}) + "\n" for line in lines))
    return lines


def dry_runs(cfg: EngineConfig, prompts: list[list[int]], max_tokens: int, pool_sizes: list[int]) -> dict:
    """Prefill tokens and steps the real scheduler plans for the file, per policy and pool size (host only)."""
    out = {}
    for pages in pool_sizes:
        for policy in POLICIES:
            start = time.perf_counter()
            plans, stats = runloop.dry_run(dataclasses.replace(cfg, policy=policy), prompts, [max_tokens] * len(prompts), num_pages=pages)
            out[f"{pages}/{policy}"] = {"num_pages": pages, "policy": policy, "prefill_tokens": sum(sum(p.num_new_tokens) for p in plans if p.phase == "prefill"),
                                        "prefix_cache_hits": stats.prefix_cache_hits, "num_steps": stats.num_steps, "num_preemptions": stats.num_preemptions,
                                        "host_seconds": time.perf_counter() - start}
    return out


def run_policy(lines: list[str], max_tokens: int, **engine_fields) -> tuple[dict, list[list[int]]]:
    """One LLM() with these EngineConfig fields: an untimed warm batch, then the file from an empty prefix cache."""
    from jaxinfer.api import LLM
    from jaxinfer.scheduling.request import SamplingParams

    llm, load_s = _timed(LLM, None, **engine_fields)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate(lines[:4], greedy, progress=False)
    llm.reset_prefix_cache()
    counted = {"prefill_tokens": 0, "prefill_steps": 0, "decode_steps": 0}

    def on_step(plan, tokens, seconds):
        counted[f"{plan.phase}_steps"] += 1
        if plan.phase == "prefill":
            counted["prefill_tokens"] += sum(plan.num_new_tokens)

    outputs, seconds = _timed(llm.generate, lines, greedy, progress=False, on_step=on_step)
    stats = llm.last_stats
    summary = {**counted, "seconds": seconds, "load_and_compile_s": load_s, "num_pages": llm.engine.num_pages,
               "prompt_tokens": sum(o.num_prompt_tokens for o in outputs), "output_tokens": sum(o.num_generated_tokens for o in outputs),
               "prefix_cache_hits": stats.prefix_cache_hits, "num_steps": stats.num_steps, "num_preemptions": stats.num_preemptions,
               "engine": {k: str(v) for k, v in dataclasses.asdict(llm.engine_config).items() if k != "buckets"}}
    tokens = [o.token_ids for o in outputs]
    del llm
    gc.collect()
    return summary, tokens


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


def parse_args():
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--preambles", type=int, default=20)
    parser.add_argument("--preamble-tokens", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--deterministic-lines", type=int, default=None, help="lines of the deterministic comparison (default: all)")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV pool pages of the real runs (default: what LLM() takes; the goal's eviction needs a pool smaller than the working set)")
    parser.add_argument("--dry-run-only", action="store_true", help="only the scheduler's dry runs (host only, seconds)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 60 lines over 4 preambles, 4 tokens each, 12 lines in deterministic mode")
    args = parser.parse_args()
    if args.quick:
        args.lines, args.preambles, args.max_tokens, args.deterministic_lines = 60, 4, 4, 12
    suffix = "_quick" if args.quick else "_dry_run" if args.dry_run_only else ""
    args.out = args.out.with_name(args.out.stem + suffix + ".json") if args.out == RESULTS else args.out
    return args


def goals(runs: dict, agreement: float | None) -> dict:
    fcfs, prefix = runs.get("fcfs"), runs.get("prefix")
    measured = {"prefill_ratio": prefix["prefill_tokens"] / fcfs["prefill_tokens"] if fcfs else None,
                "speedup": fcfs["seconds"] / prefix["seconds"] if fcfs else None, "deterministic_identical": agreement}
    return report.judge(GOALS, measured)


def run_models(args, lines: list[str]) -> tuple[dict, float | None]:
    """Both policies on the file, then both in deterministic mode on --deterministic-lines of it."""
    runs, tokens = {}, {}
    for policy in POLICIES:
        runs[policy], tokens[policy] = run_policy(lines, args.max_tokens, policy=policy, num_pages=args.num_pages)
        report.log("bench_prefix_admission", f"{policy}: {runs[policy]['prefill_tokens']} prefill tokens, {runs[policy]['seconds']:.1f}s")
    subset = lines[: args.deterministic_lines]
    for policy in POLICIES:
        runs[f"deterministic/{policy}"], tokens[f"deterministic/{policy}"] = run_policy(subset, args.max_tokens, policy=policy, deterministic=True, num_pages=args.num_pages)
        report.log("bench_prefix_admission", f"deterministic {policy}: {runs[f'deterministic/{policy}']['seconds']:.1f}s")
    same = [a == b for a, b in zip(tokens["deterministic/fcfs"], tokens["deterministic/prefix"], strict=True)]
    return runs, sum(same) / len(same)


def main() -> None:
    args = parse_args()
    tokenizer = load_tokenizer(None)
    lines = build_lines(tokenizer, args.lines, args.preambles, args.preamble_tokens)
    prompts = [tokenizer.encode(line) for line in lines]
    start = time.perf_counter()
    default_pages = runloop.pool_pages(EngineConfig())  # the pool LLM() takes where memory allows
    dry = dry_runs(EngineConfig(), prompts, args.max_tokens, [default_pages, 256, 128, 96])
    runs, agreement = ({}, None) if args.dry_run_only else run_models(args, lines)
    result = {"question": "prefix-aware admission's prefill tokens and wall time against first-come-first-served, outputs equal in deterministic mode",
              "settings": {k: str(v) for k, v in vars(args).items()},
              "workload": {"lines": len(lines), "prompt_tokens": sum(map(len, prompts)), "file": str(WORK_DIR / "lines.jsonl")},
              "dry_run": dry, "runs": runs, "deterministic_identical_share": agreement, "goals": goals(runs, agreement),
              "runtime_s": time.perf_counter() - start}
    columns = [("run", "<24"), ("pages", "6d"), ("prefill tok", "12d"), ("cache hits", "11d"), ("steps", "7d"), ("seconds", "9.2f")]
    rows = [[f"dry/{d['policy']}", d["num_pages"], d["prefill_tokens"], d["prefix_cache_hits"], d["num_steps"], d["host_seconds"]] for d in dry.values()]
    rows += [[name, r["num_pages"], r["prefill_tokens"], r["prefix_cache_hits"], r["num_steps"], r["seconds"]] for name, r in runs.items()]
    print("\n" + report.format_table(columns, rows))
    print(f"deterministic outputs identical: {agreement}")
    report.print_goals(result["goals"])
    result = report.write_result(args.out, result)
    print(json.dumps({"bench": "prefix_admission", "cpu": result["machine"]["cpu"].get("model"), "goals": {k: g["measured"] for k, g in result["goals"].items()}}))


if __name__ == "__main__":
    main()
