"""HF transformers peer of experiments/bench_forward.py: prefill and decode-step times on the same GGUF.

Runs only in the reference env (.venv-ref: CPU torch + transformers); bench_forward.py starts it as a
subprocess. Loads SmolLM2-135M-Instruct Q4_1 GGUF dequantized to float32 (the weights jaxinfer uses), or
the Hugging Face --folder given (bench_forward's random-weight geometries), then, on the prompt ids it is given:
  - last-position logits of one forward over all ids (written to --logits-out, for the correctness check);
  - prefill: that forward timed, best of --repeats;
  - decode: one token per row at batch B with a KV cache of (len(ids) - 1) tokens, copied from the B=1
    prefill, timed over --steps steps after --warmup steps (the cache grows by one token per step).
Prints one JSON document as its last stdout line.

    .venv-ref/bin/python experiments/peers/hf_forward.py --ids IDS.json --batch-sizes 1,8,32
"""

import argparse
import copy
import json
import os
import statistics
import time

import numpy as np
import torch

from hf_common import describe, load_model  # noqa: E402  (the script's folder is on sys.path)


@torch.inference_mode()
def time_prefill(model, ids: list[int], repeats: int) -> tuple[np.ndarray, list[float]]:
    """Last-position logits [V] and the wall time of each full-prompt forward."""
    tokens = torch.tensor([ids], dtype=torch.long)
    times = []
    for _ in range(repeats + 1):  # the first run is a warm-up
        start = time.perf_counter()
        out = model(input_ids=tokens, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - start)
    return out.logits[0, -1].float().numpy(), times[1:]


@torch.inference_mode()
def time_decode(model, ids: list[int], batch_sizes: list[int], warmup: int, steps: int) -> dict:
    """Seconds per decode step at each batch size, over a cache of len(ids) - 1 tokens."""
    prefix = torch.tensor([ids[:-1]], dtype=torch.long)
    base_cache = model(input_ids=prefix, use_cache=True, logits_to_keep=1).cache  # transformers 5.24 (the pin) names it `cache`
    results = {}
    for batch in batch_sizes:
        cache = copy.deepcopy(base_cache)
        cache.batch_repeat_interleave(batch)  # [B, G, S, K] per layer: every row shares the prompt
        token = torch.full((batch, 1), ids[-1], dtype=torch.long)
        times = []
        for step in range(warmup + steps):
            position = torch.full((batch, 1), len(ids) - 1 + step, dtype=torch.long)
            start = time.perf_counter()
            out = model(input_ids=token, position_ids=position, cache=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
            cache = out.cache
        results[str(batch)] = {"step_s": times[warmup:], "median_step_s": statistics.median(times[warmup:])}
        del cache
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ids", required=True, help="JSON file: a list of token ids")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefill runs")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps per batch size")
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps per batch size")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--logits-out", help="write the last-position logits (float32 .npy) here")
    parser.add_argument("--folder", help="a Hugging Face folder to load instead of the embedded GGUF")
    args = parser.parse_args()

    with open(args.ids) as file:
        ids = [int(t) for t in json.load(file)]
    model, load_s, version = load_model(args.threads, args.folder)
    logits, prefill_times = time_prefill(model, ids, args.repeats)
    if args.logits_out:
        np.save(args.logits_out, logits.astype(np.float32))
    decode = time_decode(model, ids, [int(b) for b in args.batch_sizes.split(",")], args.warmup, args.steps)
    print(json.dumps({"peer": "hf_transformers", **describe(model, version), "load_s": load_s, "prefill_tokens": len(ids),
                      "prefill_s": prefill_times, "decode": decode}))


if __name__ == "__main__":
    main()
