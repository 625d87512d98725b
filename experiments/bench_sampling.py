"""What the request surface (structured output, penalties, logprobs) costs per decode step at batch 32 on SmolLM2: structured output
(half the rows under a JSON schema), penalties + logit bias + logprobs on every row, against plain
sampling; and n samples per prompt against n separate requests (`.venv/bin/python experiments/bench_sampling.py`).

Correctness first: every constrained output must validate against its schema, and the unconstrained
rows must draw the same tokens with and without constrained neighbours. Then the decode steps that ran
all 32 rows are timed (mean and p50 ms), and the host cost of the grammar masks is timed on its own. The
half-guided run is repeated with the masks filled before the forward program instead of while it runs
(EngineConfig.overlap_masks): its outputs must be identical, and the step-time difference is the overlap's gain.
"""

import json
import statistics
import time

from common import paths, report, workloads
import jsonschema
import numpy as np

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 24, "maxItems": 24}
PROMPT = [{"role": "user", "content": "List some numbers as a JSON array."}]
OUT = paths.RESULTS_DIR / "bench_sampling.json"


def modes(args):
    from jaxinfer import SamplingParams

    plain = lambda i: SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, ignore_eos=True)  # noqa: E731
    # room to finish the array (the model may put each number on its own line); the timed steps are those
    # with all rows running, so the first max_tokens
    guided = lambda i: SamplingParams(temperature=0.8, seed=i, max_tokens=4 * args.max_tokens, structured_outputs={"json": SCHEMA})  # noqa: E731
    controls = lambda i: SamplingParams(  # noqa: E731
        temperature=0.8, seed=i, max_tokens=args.max_tokens, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3,
        repetition_penalty=1.2, logit_bias={11: 2.0, 13: -2.0}, min_p=0.05, logprobs=5,
    )
    rows = range(args.batch)
    return {
        "plain": [plain(i) for i in rows],
        "half_guided": [guided(i) if i % 2 else plain(i) for i in rows],
        "penalties_bias_logprobs": [controls(i) for i in rows],
    }


def run_mode(llm, params: list, batch: int) -> tuple[list, list[float]]:
    seconds: list[float] = []

    def on_step(plan, tokens, took):
        if plan.phase == "decode" and len(plan.request_ids) == batch:
            seconds.append(took)

    prompts = [llm.prepare(PROMPT, p, index=i, chat=True) for i, p in enumerate(params)]
    outputs = sorted(llm.stream(prompts, on_step=on_step, progress=False), key=lambda o: o.index)
    return outputs, seconds


def mask_host_ms(llm, rows: int, steps: int) -> float:
    """Host ms per step to fill `rows` grammar masks (the work token_masks adds to a step)."""
    from jaxinfer import SamplingParams
    from jaxinfer.scheduling import guided

    params = SamplingParams(structured_outputs={"json": SCHEMA})
    guides = [llm._guides.guide(params) for _ in range(rows)]
    words = np.full((rows, guided.mask_words(llm.model_config.vocab_size)), -1, np.int32)
    start = time.perf_counter()
    for _ in range(steps):
        for guide, row in zip(guides, words):
            guide.fill_mask(row)
        for guide, row in zip(guides, words):  # take an allowed token, as a draw would
            guide.advance(int(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0]))
    return (time.perf_counter() - start) / steps * 1e3


def n_versus_separate(llm, uncached, args) -> dict:
    """n samples of each of a few long prompts against the same number of separate unseeded requests (all
    admitted at once), on `llm` (whose prefix cache lets the copies share pages their first copy's chunks
    computed) and on `uncached` (prefix cache off: each request computes its prompt): output tokens/s and
    prompt tokens computed."""
    from jaxinfer import SamplingParams

    text = workloads.text_ids(llm.tokenizer)
    prompts = [text[i * 97 : i * 97 + args.n_prompt_tokens] for i in range(args.n_prompts)]
    runs = {}
    for name, engine, params, copies in (("n", llm, SamplingParams(temperature=0.8, max_tokens=args.n_max_tokens, ignore_eos=True, n=args.n), 1),
                                         ("separate", llm, SamplingParams(temperature=0.8, max_tokens=args.n_max_tokens, ignore_eos=True), args.n),
                                         ("separate_no_cache", uncached, SamplingParams(temperature=0.8, max_tokens=args.n_max_tokens, ignore_eos=True), args.n)):
        engine.reset_prefix_cache()
        start = time.perf_counter()
        outputs = engine.generate([p for p in prompts for _ in range(copies)], params, progress=False)
        seconds = time.perf_counter() - start
        samples = [s for o in outputs for s in (o.samples or [o])]
        cached = sum(s.num_cached_tokens for s in samples)
        runs[name] = {"seconds": seconds, "output_tokens_per_s": sum(len(s.token_ids) for s in samples) / seconds,
                      "num_samples": len(samples), "prompt_tokens_computed": sum(len(p) for p in prompts) * args.n - cached}
    runs["speedup"] = runs["n"]["output_tokens_per_s"] / runs["separate"]["output_tokens_per_s"]
    runs["speedup_vs_no_cache"] = runs["n"]["output_tokens_per_s"] / runs["separate_no_cache"]["output_tokens_per_s"]
    return runs


def check(outputs: dict) -> dict:
    """Constrained outputs validate; unconstrained rows are unchanged by constrained neighbours."""
    valid = 0
    for i, output in enumerate(outputs["half_guided"]):
        if i % 2:
            jsonschema.validate(json.loads(output.text), SCHEMA)
            valid += 1
    unchanged = all(outputs["half_guided"][i].token_ids == outputs["plain"][i].token_ids for i in range(0, len(outputs["plain"]), 2))
    logprobs = all(len(o.logprobs) == len(o.token_ids) for o in outputs["penalties_bias_logprobs"])
    overlap = [o.token_ids for o in outputs["half_guided"]] == [o.token_ids for o in outputs["half_guided_masks_first"]]
    return {"constrained_valid": valid, "unconstrained_unchanged": unchanged, "logprobs_per_token": logprobs, "overlap_outputs_identical": overlap}


def main() -> None:
    parser = report.arg_parser(__doc__, out=OUT)
    parser.add_argument("--batch", type=int, default=32, help="rows per decode step (default 32)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt in the n section (default 4)")
    parser.add_argument("--n-prompts", type=int, default=4, help="prompts in the n section (default 4)")
    parser.add_argument("--n-prompt-tokens", type=int, default=500, help="tokens per prompt in the n section (default 500)")
    parser.add_argument("--n-max-tokens", type=int, default=16, help="tokens per sample in the n section (default 16)")
    args = parser.parse_args()
    from jaxinfer import LLM

    llm = LLM(None, max_num_seqs=args.batch, page_size=16)
    outputs, steps = {}, {}
    for name, params in modes(args).items():
        run_mode(llm, params, args.batch)  # warm: the grammar tokenizer, first-use costs
        outputs[name], steps[name] = run_mode(llm, params, args.batch)
    llm.engine.overlap_masks = False  # the same programs, the masks filled before the forward instead of during it
    outputs["half_guided_masks_first"], steps["half_guided_masks_first"] = run_mode(llm, modes(args)["half_guided"], args.batch)
    llm.engine.overlap_masks = True
    checks = check(outputs)
    base = statistics.mean(steps["plain"])
    rows = [[name, len(s), f"{statistics.mean(s) * 1e3:.1f}", f"{statistics.median(s) * 1e3:.1f}", f"{statistics.mean(s) / base:.3f}"] for name, s in steps.items()]
    print(report.format_table([("mode", "<"), ("steps", ">"), ("mean ms", ">"), ("p50 ms", ">"), ("vs plain", ">")], rows))
    fanout = n_versus_separate(llm, LLM(None, max_num_seqs=args.batch, page_size=16, enable_prefix_caching=False), args)
    print(f"n={args.n} on {args.n_prompts} prompts of {args.n_prompt_tokens} tokens: {fanout['n']['output_tokens_per_s']:.1f} output tok/s, "
          f"{fanout['n']['prompt_tokens_computed']} prompt tokens computed; separate: {fanout['separate']['output_tokens_per_s']:.1f} tok/s, "
          f"{fanout['separate']['prompt_tokens_computed']} computed; speedup {fanout['speedup']:.2f}x; against separate requests with the prefix "
          f"cache off ({fanout['separate_no_cache']['prompt_tokens_computed']} computed): {fanout['speedup_vs_no_cache']:.2f}x")
    host = mask_host_ms(llm, args.batch // 2, 20)
    print(f"grammar masks, {args.batch // 2} rows: {host:.2f} ms of host time per step; checks: {checks}")
    doc = {
        "batch": args.batch, "max_tokens": args.max_tokens, "checks": checks, "mask_host_ms_per_step": host,
        "decode_step_ms": {name: {"mean": statistics.mean(s) * 1e3, "p50": statistics.median(s) * 1e3, "steps": len(s)} for name, s in steps.items()},
        "overhead_vs_plain": {name: statistics.mean(s) / base - 1 for name, s in steps.items()},
        "attention_impl": llm.engine.impl, "n_versus_separate": fanout,
    }
    summary = {name: f"{(statistics.mean(s) / base - 1) * 100:+.1f}%" for name, s in steps.items()} | {"n_speedup": round(fanout["speedup"], 2), "n_speedup_vs_no_cache": round(fanout["speedup_vs_no_cache"], 2)}
    correct = checks["constrained_valid"] == args.batch // 2 and all(checks[k] for k in ("unconstrained_unchanged", "logprobs_per_token", "overlap_outputs_identical"))
    report.finish(args.out, doc, summary, correct=correct)


if __name__ == "__main__":
    main()
