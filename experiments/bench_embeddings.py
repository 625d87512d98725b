"""How fast is LLM.embed beside LLM.generate's prefill, on the same prompts in the same run?

SmolLM2-135M-Instruct (f32) on this CPU (--quick: the random tiny Llama over SmolLM2's tokenizer, fewer
prompts: a smoke run, not a measurement). --num-prompts passages of the real text (experiments/data), 32 to
--max-prompt-tokens tokens. Runs, best of --repeats, each after an untimed call, every one from an empty
prefix cache:
  embed_last   LLM.embed(prompts, pooling="last"): requests that prefill on the paged programs compiled at
               warm-up and generate nothing, each slot's last hidden state pooled;
  embed_mean   the same, mean pooling (the chunk sums);
  prefill      LLM.generate(prompts, max_tokens=1): the same prefill and one draw per prompt.
Throughput is prompt tokens per second. Correctness first: each prompt's vector embedded alone equals the
batched one within 1e-5 (the values against transformers are tests/front/test_embeddings.py's), and nothing
compiles after warm-up (a CompileCounter around every call; `compiles_after_warmup` must be 0). Writes
experiments/results/bench_embeddings.json (--quick: build/bench_embeddings/quick.json); the last stdout line
is one JSON document.

    .venv/bin/python experiments/bench_embeddings.py [--num-prompts 64] [--max-prompt-tokens 256] [--repeats 3] [--quick]
"""

import time

import numpy as np

from common import engine_runs, paths, report, timing, workloads
from common.paths import REPO_ROOT
from jaxinfer.api import LLM
from jaxinfer.engine.engine import CompileCounter
from jaxinfer.scheduling.request import SamplingParams

RESULTS = paths.RESULTS_DIR / "bench_embeddings.json"
WORK_DIR = REPO_ROOT / "build" / "bench_embeddings"
TOLERANCE = 1e-5


def parse_args():
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (best kept)")
    parser.add_argument("--quick", action="store_true", help="tiny random model, 12 prompts, one repeat (a smoke run)")
    args = parser.parse_args()
    if args.quick:  # written beside the build, so a smoke run never replaces the measured result
        args.num_prompts, args.max_prompt_tokens, args.repeats, args.out = 12, 96, 1, WORK_DIR / "quick.json"
    return args


def make_llm(quick: bool) -> LLM:
    model = None
    if quick:
        from jaxinfer.loading.tiny_model import save_tiny_llama
        from jaxinfer.loading.tokenizer import load_tokenizer

        model = str(save_tiny_llama(WORK_DIR / "tiny_model", load_tokenizer(None)))
    cfg = engine_runs.workload_engine_config(max_num_seqs=16, max_context=512, compilation_cache_dir=str(WORK_DIR / "xla_cache"))
    llm, seconds = timing.timed(LLM, model, dtype="float32", engine_config=cfg)
    report.log("bench_embeddings", f"loaded and compiled {llm.engine.num_compilations} generation programs in {seconds:.1f}s")
    return llm


def prompts_of(llm: LLM, num_prompts: int, max_tokens: int) -> list[list[int]]:
    text = workloads.text_ids(llm.tokenizer)
    lengths = np.linspace(32, max_tokens, num_prompts).astype(int)
    starts = [97 * i % (len(text) - max_tokens) for i in range(num_prompts)]  # distinct passages, wrapping round the text
    return [text[start : start + n] for start, n in zip(starts, lengths)]


def best_of(repeats: int, run) -> dict:
    run()  # untimed: first-call costs (nothing compiles: warm-up compiled the programs)
    seconds = [timing.timed(run)[1] for _ in range(repeats)]
    return {"seconds": min(seconds), "all_seconds": seconds}


def check(llm: LLM, prompts: list[list[int]]) -> float:
    """Largest difference between a prompt embedded alone and in the batch, over both poolings."""
    worst = 0.0
    for pooling in ("last", "mean"):
        batched = llm.embed(prompts, pooling=pooling)
        for i in (0, len(prompts) // 2, len(prompts) - 1):
            worst = max(worst, float(np.abs(llm.embed([prompts[i]], pooling=pooling)[0].embedding - batched[i].embedding).max()))
    return worst


def main() -> None:
    args = parse_args()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    llm = make_llm(args.quick)
    prompts = prompts_of(llm, args.num_prompts, args.max_prompt_tokens)
    num_tokens = sum(map(len, prompts))
    start = time.perf_counter()
    compiled_before = llm.engine.num_compilations
    with CompileCounter() as counter:
        diff = check(llm, prompts)

        def from_empty_cache(run):  # a "last" embedding may start from cached pages: every run starts without any
            return lambda: (llm.reset_prefix_cache(), run())

        runs = {"embed_last": best_of(args.repeats, from_empty_cache(lambda: llm.embed(prompts, pooling="last"))),
                "embed_mean": best_of(args.repeats, from_empty_cache(lambda: llm.embed(prompts, pooling="mean"))),
                "prefill": best_of(args.repeats, from_empty_cache(lambda: llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), progress=False)))}
    for run in runs.values():
        run["tokens_per_s"] = num_tokens / run["seconds"]
    measured = {f"{name}_tokens_per_s": run["tokens_per_s"] for name, run in runs.items()}
    measured |= {"embed_last_vs_prefill": runs["prefill"]["seconds"] / runs["embed_last"]["seconds"], "max_abs_diff": diff, "compiles_after_warmup": counter.count}
    columns = [("run", "<11"), ("seconds", "9.3f"), ("prompt tokens", "14d"), ("tokens/s", "10.1f"), ("vs prefill", "11.2f")]
    print("\n" + report.format_table(columns, [[n, r["seconds"], num_tokens, r["tokens_per_s"], r["tokens_per_s"] / runs["prefill"]["tokens_per_s"]] for n, r in runs.items()]))
    doc = {"question": "LLM.embed throughput beside LLM.generate's prefill, same prompts, same run", "settings": {k: str(v) for k, v in vars(args).items()},
           "model": "tiny random Llama (quick)" if args.quick else "SmolLM2-135M-Instruct f32", "num_prompts": len(prompts), "prompt_tokens": num_tokens,
           "runs": runs, "measured": measured, "generation_programs": compiled_before, "runtime_s": time.perf_counter() - start}
    report.finish(args.out, doc, {"bench": "embeddings", "quick": args.quick, **measured}, correct=diff <= TOLERANCE and counter.count == 0)


if __name__ == "__main__":
    main()
