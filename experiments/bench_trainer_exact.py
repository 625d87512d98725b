"""What do trainer-exact logprobs cost in decode throughput, and how fast is LLM.update_params?

SmolLM2-135M-Instruct (f32) on this CPU. Correctness first: --rollouts sampled rollouts (temperature 1,
logprobs=0) of a deterministic LLM, whose every reported logprob must equal jaxinfer.logprobs bit for
bit. Then decode throughput of the same workload (--prompts prompts of 20 to 90 tokens, --max-tokens
tokens each, ignore_eos, max_num_seqs 8) in three engines:
  deterministic   deterministic=True: attention_over_page_blocks (KV blocks of 8 pages in position order),
                  fixed 64-token prefill chunks and 8-row decode programs (what trainer-exactness needs);
  reference       the default tables, attention_impl='reference' and XLA matmuls (one full softmax);
  default         the default engine (the tuner's choice here: the CPU kernels where they are built).
Decode tokens/s = generated tokens after the first per request / the time from the first decode step to
the end (steps timed through on_step). Then update_params on the deterministic and the default LLM (the
latter repacks the CPU kernels' panels): the swap's seconds, best of --repeats, and the compiles it caused
(CompileCounter, must be 0). Writes experiments/results/bench_trainer_exact.json (--quick: beside the build,
never replacing the measured result); the last stdout line is one JSON document.

    .venv/bin/python experiments/bench_trainer_exact.py [--rollouts 64] [--prompts 16] [--max-tokens 64] [--repeats 3] [--quick]
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from common import paths, report, timing
from common.paths import REPO_ROOT
from jaxinfer.api import LLM
from jaxinfer.engine.engine import CompileCounter
from jaxinfer.scheduling.request import SamplingParams

RESULTS = paths.RESULTS_DIR / "bench_trainer_exact.json"
WORK_DIR = REPO_ROOT / "build" / "bench_trainer_exact"
LIMITS = dict(max_context=512, page_size=16, max_num_seqs=8, max_prefill_tokens=256)
GOALS = {"mismatched_tokens": ("every reported logprob equals jaxinfer.logprobs bit for bit", 0.0, "at_most"),
         "swap_seconds": ("update_params takes <= 2 s on SmolLM2", 2.0, "at_most"),
         "swap_compiles": ("update_params and the next generate compile nothing", 0.0, "at_most")}


def parse_args():
    parser = report.arg_parser(__doc__, out=RESULTS)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8 rollouts, 8 prompts of 16 tokens, one repeat (a smoke run, not a measurement)")
    args = parser.parse_args()
    if args.quick:
        args.rollouts, args.prompts, args.max_tokens, args.repeats, args.out = 8, 8, 16, 1, WORK_DIR / "quick.json"
    return args


def prompts(count: int) -> list[list[int]]:
    return [[(17 * i + 5 * j) % 3000 + 100 for j in range(20 + 70 * i // max(count - 1, 1))] for i in range(count)]


def make_llm(**fields) -> LLM:
    llm, seconds = timing.timed(LLM, None, dtype="float32", compilation_cache_dir=str(WORK_DIR / "xla_cache"), **LIMITS, **fields)
    report.log("bench_trainer_exact", f"{fields}: {llm.choices.describe()}, {llm.engine.num_compilations} programs in {seconds:.1f}s")
    return llm


def check_rollouts(llm: LLM, count: int) -> dict:
    """Rollouts of 8 prompts (count / 8 samples each): tokens whose reported logprob differs from jaxinfer.logprobs."""
    chosen = prompts(8)
    sampling = SamplingParams(temperature=1.0, seed=7, n=max(count // 8, 1), max_tokens=24, logprobs=0, ignore_eos=True)
    pure = jax.jit(jaxinfer.logprobs, static_argnames=("cfg", "prompt_len", "engine_config"))
    checked = mismatched = 0
    for prompt, output in zip(chosen, llm.generate(chosen, sampling, progress=False)):
        for sample in output.samples or [output]:
            reported = np.asarray([lp for lp, _ in sample.logprobs], np.float32)
            tokens = jnp.asarray(prompt + sample.token_ids, jnp.int32)
            mine = np.asarray(pure(llm.params, tokens, llm.model_config, prompt_len=len(prompt), engine_config=llm.engine_config))[len(prompt) - 1 :]
            checked, mismatched = checked + reported.size, mismatched + int((mine != reported).sum())
    return {"rollouts": len(chosen) * sampling.n, "tokens": checked, "mismatched": mismatched}


def decode_rate(llm: LLM, work: list[list[int]], max_tokens: int, repeats: int) -> dict:
    """Best of `repeats`: decode tokens/s (each request's tokens after its first, over the decode steps' seconds)."""
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    best = None
    for _ in range(repeats):
        llm.reset_prefix_cache()
        seconds = {"decode": 0.0, "prefill": 0.0}

        def on_step(plan, tokens, elapsed):
            seconds[plan.phase] += elapsed

        outputs = llm.generate(work, sampling, progress=False, on_step=on_step)
        tokens = sum(len(o.token_ids) - 1 for o in outputs)
        run = {"decode_tokens": tokens, "decode_seconds": seconds["decode"], "prefill_seconds": seconds["prefill"], "decode_tokens_per_s": tokens / seconds["decode"]}
        best = run if best is None or run["decode_tokens_per_s"] > best["decode_tokens_per_s"] else best
    return best


def swap_time(llm: LLM, repeats: int) -> dict:
    """update_params with the weights plus a small perturbation: seconds (best, all) and compiles, the next generate's included."""
    leaves, tree = jax.tree.flatten(llm.params)
    new = jax.tree.unflatten(tree, [leaf * 1.001 for leaf in leaves])
    runs = []
    with CompileCounter() as counter:
        for _ in range(repeats):  # the repack is dispatched asynchronously: timed until the step params are ready
            runs.append(timing.timed(lambda: jax.block_until_ready(jax.tree.leaves(llm.engine.step_params) if llm.update_params(new) else None))[1])
        llm.generate(prompts(2), SamplingParams(temperature=0, max_tokens=4), progress=False)
    return {"seconds": min(runs), "all_seconds": runs, "compiles": counter.count, "weight_version": llm.weight_version}


def main() -> None:
    args = parse_args()
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    work = prompts(args.prompts)
    engines = {"deterministic": dict(deterministic=True), "reference": dict(attention_impl="reference", matmul_impl="xla"), "default": {}}
    runs, swaps, check = {}, {}, None
    for name, fields in engines.items():
        llm = make_llm(**fields)
        if name == "deterministic":
            check = check_rollouts(llm, args.rollouts)
            report.log("bench_trainer_exact", f"checked {check['tokens']} tokens of {check['rollouts']} rollouts: {check['mismatched']} mismatched")
        runs[name] = {"impls": llm.choices.describe(), **decode_rate(llm, work, args.max_tokens, args.repeats)}
        if name in ("deterministic", "default"):
            swaps[name] = swap_time(llm, args.repeats)
        del llm
    base = runs["deterministic"]["decode_tokens_per_s"]
    columns = [("engine", "<14"), ("impls", "<46"), ("decode tok/s", "13.1f"), ("vs deterministic", "17.2f"), ("swap s", "8.3f"), ("compiles", "9d")]
    rows = [[n, r["impls"], r["decode_tokens_per_s"], r["decode_tokens_per_s"] / base, swaps.get(n, {}).get("seconds"), swaps.get(n, {}).get("compiles")] for n, r in runs.items()]
    print("\n" + report.format_table(columns, rows))
    measured = {"mismatched_tokens": check["mismatched"], "swap_seconds": max(s["seconds"] for s in swaps.values()),
                "swap_compiles": sum(s["compiles"] for s in swaps.values()),
                "deterministic_vs_reference": base / runs["reference"]["decode_tokens_per_s"],
                "deterministic_vs_default": base / runs["default"]["decode_tokens_per_s"]}
    judged = report.judge(GOALS, measured)
    report.print_goals(judged)
    doc = {"question": "the decode cost of trainer-exact (deterministic) logprobs, and update_params' swap time", "settings": {k: str(v) for k, v in vars(args).items()},
           "limits": LIMITS, "check": check, "runs": runs, "swaps": swaps, "measured": measured, "goals": judged, "runtime_s": time.perf_counter() - start}
    report.finish(args.out, doc, {"bench": "trainer_exact", "quick": args.quick, **measured}, correct=check["mismatched"] == 0)


if __name__ == "__main__":
    main()
