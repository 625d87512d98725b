"""Does prefix caching pay on shared prompts, cost nothing without sharing, and what does deterministic mode cost?

Three workloads of the common scaled trace: (a) shared_system, 64 requests behind
one 400-token system prompt; (b) multi_turn, 16 four-turn conversations, each turn resending the history;
(c) no_sharing, bench_engine.py's workload. jaxinfer with the prefix cache, without it, and in
deterministic mode (on c) take turns workload by workload ((c) --repeats times, best kept), each run from
an empty cache; llama.cpp runs (a) batched and with the shared prefix copied into every sequence, and (c).
Correctness first: greedy tokens with the cache equal those without it.

    .venv/bin/python experiments/bench_prefix.py [--num-requests 64] [--scale 8] [--repeats 2] [--quick]
"""

import json
import time

import numpy as np

from common import engine_runs, paths, peers, report, timing, workloads
from common.paths import REPO_ROOT
from jaxinfer.api import LLM
from jaxinfer.loading.tokenizer import load_tokenizer

RESULTS = paths.RESULTS_DIR / "bench_prefix.json"
WORK_DIR = REPO_ROOT / "build" / "bench_prefix"
MAX_CONTEXT = engine_runs.WORKLOAD_MAX_CONTEXT
SYSTEM_TOKENS = 400
GOALS = {"a_speedup": ("A: shared system prompt, cache on >= 2x the tok/s of cache off", 2.0, "at_least"),
         "a_ttft_p50_reduction": ("A: TTFT p50 with the cache >= 3x lower", 3.0, "at_least"),
         "c_within": ("C: no sharing, the cache costs <= 3% of tok/s", 0.03, "at_most"),
         "deterministic_cost_c": ("C: deterministic mode costs <= 15% of tok/s", 0.15, "at_most")}


def shared_system_workload(args, tokenizer) -> list[dict]:
    """(a): one 400-token system prompt in front of each trace request's own prompt."""
    system = workloads.text_ids(tokenizer)[:SYSTEM_TOKENS]
    turns = _workload(args, args.num_requests, 1, tokenizer)
    return [{"prompt_ids": (system + r["prompt_ids"])[: MAX_CONTEXT - r["max_tokens"]], "max_tokens": r["max_tokens"]} for r in turns]


def conversation_turns(args, tokenizer) -> list[list[dict]]:
    """(b): user turns and reply lengths of 16 conversations x 4 turns (history is added at run time)."""
    turns = _workload(args, 16 * 4, 2, tokenizer)
    return [[{"user_ids": t["prompt_ids"][:120], "max_tokens": min(t["max_tokens"], 48)} for t in turns[c::16]] for c in range(16)]


def _workload(args, num_requests: int, seed: int, tokenizer) -> list[dict]:
    """bench_engine.py's workload: the common scaled trace sample at this seed."""
    return workloads.build_workload(args.trace, num_requests, args.scale, seed, tokenizer, max_context=MAX_CONTEXT)["requests"]


def make_llm(args, **fields) -> LLM:
    """The common workload engine with these EngineConfig fields (compile cache under WORK_DIR), warmed up."""
    cfg = engine_runs.workload_engine_config(max_num_seqs=args.max_num_seqs, page_size=args.page_size, compilation_cache_dir=str(WORK_DIR / "xla_cache"), **fields)
    llm, seconds = timing.timed(LLM, None, engine_config=cfg)
    print(f"jaxinfer {fields}: loaded and compiled {llm.engine.num_compilations} programs in {seconds:.1f}s", flush=True)
    return llm


def _summary(outputs: list, seconds: float, stats: list) -> dict:
    ttfts = [o.time_to_first_token for o in outputs]
    queried, hits = sum(s.prefix_cache_queries for s in stats), sum(s.prefix_cache_hits for s in stats)
    return {"seconds": seconds, "num_output_tokens": sum(o.num_generated_tokens for o in outputs),
            "output_tokens_per_s": sum(o.num_generated_tokens for o in outputs) / seconds,
            "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p99_s": float(np.percentile(ttfts, 99)),
            "prompt_tokens": sum(o.num_prompt_tokens for o in outputs), "prefill_tokens_saved": hits,
            "hit_rate": hits / queried if queried else 0.0, "num_steps": sum(s.num_steps for s in stats)}


def run_single(llm: LLM, requests: list[dict]) -> tuple[dict, list[list[int]]]:
    """One batch from an empty cache."""
    llm.reset_prefix_cache()
    outputs, seconds = timing.timed(workloads.generate, llm, requests)
    return _summary(outputs, seconds, [llm.last_stats]), [o.token_ids for o in outputs]


def run_multi_turn(llm: LLM, conversations: list[list[dict]]) -> tuple[dict, list[list[int]]]:
    """Turn after turn, each resending the history (its replies as generated), from an empty cache."""
    llm.reset_prefix_cache()
    histories, all_outputs, stats, seconds = [[] for _ in conversations], [], [], 0.0
    for turn in range(len(conversations[0])):
        requests = [{"prompt_ids": h + c[turn]["user_ids"], "max_tokens": c[turn]["max_tokens"]} for h, c in zip(histories, conversations)]
        outputs, elapsed = timing.timed(workloads.generate, llm, requests)
        seconds += elapsed
        stats.append(llm.last_stats)
        histories = [r["prompt_ids"] + o.token_ids for r, o in zip(requests, outputs)]
        all_outputs += outputs
    return _summary(all_outputs, seconds, stats), [o.token_ids for o in all_outputs]


def run_llamacpp(requests: list[dict], name: str, extra: list[str]) -> dict:
    path = WORK_DIR / f"{name}.json"
    path.write_text(json.dumps({"requests": requests}))
    raw, _ = peers.run_generate_peer("llamacpp_generate.py", path, WORK_DIR / f"{name}_tokens.json", "--parallel", "32", *extra)
    return {"error": raw["error"][-1500:]} if "error" in raw else raw["modes"]


def parse_args():
    parser = report.arg_parser(__doc__, out=RESULTS, trace=True)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--scale", type=float, default=8.0)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="runs per runner on (c), interleaved; the best counts")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 requests at scale 32, no llama.cpp")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.scale, args.no_llamacpp, args.repeats = 8, 32.0, True, 1
    return args


RUNNERS = (("cache", {}), ("no_cache", {"enable_prefix_caching": False}), ("deterministic", {"deterministic": True}))


def run_jaxinfer(args, named_workloads: dict) -> tuple[dict, dict]:
    """Every runner on every workload (deterministic: on (c) only). The three engines are built first and
    take turns, workload by workload, so a change in machine load between runners hits all of them. (c),
    whose goal is a 3% bound, runs --repeats times per runner, interleaved, and keeps each runner's best."""
    llms = {name: make_llm(args, **fields) for name, fields in RUNNERS}
    for llm in llms.values():
        run_single(llm, named_workloads["no_sharing"][:4])  # untimed: first-call costs out of the way
    results, tokens = {}, {}
    for workload, data in named_workloads.items():
        runner = run_multi_turn if workload == "multi_turn" else run_single
        for repeat in range(args.repeats if workload == "no_sharing" else 1):
            for name, llm in llms.items():
                if name == "deterministic" and workload != "no_sharing":
                    continue
                key = f"{workload}/jaxinfer_{name}"
                summary, tokens[(workload, name)] = runner(llm, data)
                print(f"{workload:<14} jaxinfer_{name:<14} {summary['output_tokens_per_s']:7.1f} tokens/s (run {repeat + 1})", flush=True)
                runs = results.get(key, {}).get("seconds_per_run", []) + [summary["seconds"]]
                if key not in results or summary["seconds"] < results[key]["seconds"]:
                    results[key] = summary
                results[key]["seconds_per_run"] = runs
    return results, tokens


def run_peers(args, named_workloads: dict) -> dict:
    if args.no_llamacpp or not paths.REF_PYTHON.exists():
        return {}
    results = {}
    for workload, extra in (("shared_system", ["--modes", "batched,batched_prefix", "--shared-prefix", str(SYSTEM_TOKENS)]), ("no_sharing", ["--modes", "batched"])):
        modes = run_llamacpp(named_workloads[workload], workload, extra)
        for mode, entry in (modes.items() if "error" not in modes else [("error", modes)]):
            results[f"{workload}/llamacpp_{mode}"] = entry
            print(f"{workload:<14} llamacpp_{mode:<14} {entry.get('output_tokens_per_s', float('nan')):7.1f} tokens/s", flush=True)
    return results


def goals(results: dict) -> dict:
    a_on, a_off = results["shared_system/jaxinfer_cache"], results["shared_system/jaxinfer_no_cache"]
    c_on, c_off, c_det = (results[f"no_sharing/jaxinfer_{n}"] for n in ("cache", "no_cache", "deterministic"))
    measured = {
        "a_speedup": a_on["output_tokens_per_s"] / a_off["output_tokens_per_s"],
        "a_ttft_p50_reduction": a_off["ttft_p50_s"] / a_on["ttft_p50_s"],
        "c_within": 1 - c_on["output_tokens_per_s"] / c_off["output_tokens_per_s"],
        "deterministic_cost_c": 1 - c_det["output_tokens_per_s"] / c_off["output_tokens_per_s"],
    }
    return report.judge(GOALS, measured)


def main() -> None:
    args = parse_args()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(None)
    named_workloads = {"shared_system": shared_system_workload(args, tokenizer), "multi_turn": conversation_turns(args, tokenizer),
                 "no_sharing": _workload(args, args.num_requests, 0, tokenizer)}
    start = time.perf_counter()
    results, tokens = run_jaxinfer(args, named_workloads)
    exact = lambda a, b: workloads.agreement(a, b)["exact_requests"]  # noqa: E731  (share of requests with identical tokens)
    correctness = {w: exact(tokens[(w, "cache")], tokens[(w, "no_cache")]) for w in named_workloads}
    correctness["no_sharing_deterministic"] = exact(tokens[("no_sharing", "deterministic")], tokens[("no_sharing", "no_cache")])
    results |= run_peers(args, named_workloads)
    result = {
        "question": "prefix caching's gain on shared prompts and cost without sharing; deterministic mode's cost",
        "settings": {k: str(v) for k, v in vars(args).items()},
        "greedy_agreement_cache_vs_no_cache": correctness, "results": results, "goals": goals(results),
        "runtime_s": time.perf_counter() - start,
    }
    columns = [("workload/runner", "<42"), ("tok/s", "8.1f"), ("TTFT p50", "9.2f"), ("TTFT p99", "9.2f"), ("hit rate", "9.1%"), ("saved", "7d")]
    print("\n" + report.format_table(columns, [[key, r["output_tokens_per_s"], r.get("ttft_p50_s"), r.get("ttft_p99_s"), r.get("hit_rate"),
                                                 r.get("prefill_tokens_saved", 0)] for key, r in results.items() if "output_tokens_per_s" in r]))
    print(f"greedy agreement, cache vs no cache: {correctness}")
    report.print_goals(result["goals"])
    result = report.write_result(args.out, result)
    print(json.dumps({"bench": "prefix", "agreement": correctness, "goals": {k: g["measured"] for k, g in result["goals"].items()}}))


if __name__ == "__main__":
    main()
