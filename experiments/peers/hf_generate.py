"""HF transformers peer of experiments/bench_engine.py: batched greedy `generate` over the shared workload.

Runs only in the reference env (.venv-ref); bench_engine.py starts it as a subprocess. Reads the workload
JSON (token ids + max_tokens per request), loads the same GGUF dequantized to float32, and runs the
requests in arrival order in static batches of --batch-size: left padding with an attention mask,
greedy, `max_new_tokens` = the batch's largest request, EOS not a stop (like ignore_eos). Only each
request's own max_tokens count as useful output; the rest of its row is padding work.
A two-token generate warms up first (untimed); the workload is timed --repeats times, the best reported. Writes each request's first max_tokens generated ids to
--out and prints one JSON document as its last stdout line.

    .venv-ref/bin/python experiments/peers/hf_generate.py --workload W.json --out TOKENS.json --batch-size 8
"""

import argparse
import copy
import json
import os
import time

import torch

from hf_common import describe, load_model  # noqa: E402  (the script's folder is on sys.path)

PAD_ID = 0  # any id works: padded positions are masked out


def greedy_config(model, max_new_tokens: int):
    """Greedy, exactly max_new_tokens: no EOS stop (EOS may still be chosen, as with ignore_eos)."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.pad_token_id = PAD_ID
    config.do_sample = False
    config.temperature, config.top_k, config.top_p = None, None, None
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = None
    return config


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and attention mask [B, T_max], prompts aligned to the right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    ids, mask = left_pad(prompts)
    new_tokens = max(max_tokens)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=greedy_config(model, new_tokens))
    generated = out[:, ids.shape[1]:]
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"generate returned {generated.shape[1]} new tokens, expected {new_tokens}")
    return [generated[row, :n].tolist() for row, n in enumerate(max_tokens)]


def run_workload(model, requests: list[dict], batch_size: int) -> tuple[float, list[list[int]], list[dict]]:
    """All requests in arrival-order batches; returns (seconds, ids per request, per-batch records)."""
    outputs, batches = [], []
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        batch_start = time.perf_counter()
        outputs += generate_batch(model, [r["prompt_ids"] for r in batch], [r["max_tokens"] for r in batch])
        batches.append({
            "size": len(batch), "seconds": time.perf_counter() - batch_start,
            "padded_prompt_tokens": len(batch) * max(len(r["prompt_ids"]) for r in batch),
            "padded_generated_tokens": len(batch) * max(r["max_tokens"] for r in batch),
        })
    return time.perf_counter() - start, outputs, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True, help="JSON file: generated ids per request")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of the workload; the best is reported")
    parser.add_argument("--gguf", help="a GGUF file to run (default: the embedded SmolLM2 GGUF)")
    args = parser.parse_args()

    with open(args.workload) as file:
        requests = json.load(file)["requests"]
    model, load_s, version = load_model(args.threads, gguf=args.gguf)
    start = time.perf_counter()
    generate_batch(model, [requests[0]["prompt_ids"]], [2])
    warmup_s = time.perf_counter() - start

    runs = [run_workload(model, requests, args.batch_size) for _ in range(args.repeats)]
    seconds, outputs, batches = min(runs, key=lambda run: run[0])
    with open(args.out, "w") as file:
        json.dump(outputs, file)
    num_output = sum(len(o) for o in outputs)
    print(json.dumps({
        "peer": "hf_transformers_generate", **describe(model, version), "batch_size": args.batch_size, "batching": "static batches in arrival order, left padding",
        "load_s": load_s, "warmup_s": warmup_s, "seconds": seconds, "seconds_per_repeat": [run[0] for run in runs],
        "repeats_identical_tokens": all(run[1] == outputs for run in runs), "num_requests": len(outputs),
        "num_output_tokens": num_output, "output_tokens_per_s": num_output / seconds, "batches": batches,
    }))


if __name__ == "__main__":
    main()
