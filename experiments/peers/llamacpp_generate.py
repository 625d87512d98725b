"""llama.cpp peer of experiments/bench_engine.py: greedy generation over the shared workload.

Runs only in the reference env (.venv-ref) with llama-cpp-python (`make setup-bench`); bench_engine.py
starts it as a subprocess. Uses the low-level API (llama_batch + llama_decode) on the same Q4_1 GGUF,
computed the llama.cpp way (quantized weights, f16 KV cache), in these modes:
  sequential  one stream: each request's prompt in chunks of up to n_batch tokens, then one token per
              llama_decode, request after request;
  batched     continuous batching over --parallel sequence ids in one context: every llama_decode
              carries one token for each decoding sequence plus prompt chunks of newly admitted ones
              (up to n_batch tokens); a finished sequence's cells are removed and its slot is refilled
              in arrival order. KV layout: llama.cpp's default, kv_unified = false (one KV stream of
              MAX_CONTEXT cells per sequence id);
  batched_prefix  the same, but the first --shared-prefix tokens (common to every request) are decoded once
              into a spare sequence id and shared with each admitted sequence (llama_memory_seq_cp), so only
              the rest of each prompt is computed. This needs kv_unified = true (one KV buffer for all
              sequence ids, as llama-server's --kv-unified / llama-parallel's shared system prompt);
  batched_unified  batched (no sharing) with kv_unified = true: isolates the layout's cost from the sharing;
  batched_prefix_copy  batched_prefix with the default layout (kv_unified = false): the prefix is copied,
              not shared (a whole-stream K/V buffer copy per admitted sequence).
Sharing is exact: a sequence given the prefix by seq_cp (either layout) has bit-identical logits to one that
decoded the prefix itself in the same chunks. Tokens can still differ from `batched`, which computes the
prefix inside other prompt chunks: llama.cpp's CPU results depend on how tokens are grouped into ubatches
(up to ~0.6 in a logit here), so greedy picks can flip where the top two logits are close.

What llama.cpp (llama-cpp-python 0.3.36, src/llama-kv-cache.cpp llama_kv_cache::seq_cp) can share:
  - kv_unified = true: every sequence id lives in the one stream, and seq_cp(src, dst, p0, p1) only adds dst
    to the sequence set of src's cells at positions [p0, p1); no K/V data moves, the prefix is stored once,
    any position range is allowed. seq_rm(dst) later drops dst from those cells; they stay while src holds
    them. The cost: each ubatch's attention spans every cell up to the highest one any sequence uses (padded
    to 256, others' cells masked), not only its own stream's.
  - kv_unified = false (the default): each sequence id has its own stream (n_ctx / n_seq_max cells). seq_cp
    between two streams cannot share: it resets dst's stream (dst loses what it held) and, at the next
    decode, copies src's whole K/V buffers (every cell of the stream, every layer) into dst's; so only the
    whole sequence can be copied: p0 and p1 must each be <= 0 or >= stream size - 1 (-1, -1 in practice),
    and any other range, e.g. the earlier seq_cp(src, dst, 0, N) here, aborts with GGML_ASSERT "seq_cp() is
    only supported for full KV buffers". The prefix then exists once per sequence, and its compute is
    saved, not its memory.
  - Neither layout shares a prefix at other positions (cells carry absolute positions: dst gets src's cells
    at src's positions), nor across contexts; and sharing is always explicit: llama_decode never finds on its
    own that another sequence holds the same tokens. (llama-server reuses a slot's own previous prompt, saves
    and restores sequence states to and from a host-memory prompt cache as data copies, and seq_cp's whole
    sequences between slots only for n > 1 completions of one prompt.)
Greedy = argmax of the returned logits; EOS is not a stop. Each mode warms up (untimed) first, then
times the workload --repeats times and reports the best.
Writes {mode: ids per request} to --out and prints one JSON document as its last stdout line.

    .venv-ref/bin/python experiments/peers/llamacpp_generate.py --workload W.json --out TOKENS.json --parallel 16
    .venv-ref/bin/python experiments/peers/llamacpp_generate.py --workload W.json --out TOKENS.json \
        --modes batched,batched_prefix --shared-prefix 400

W.json: {"requests": [{"prompt_ids": [int, ...], "max_tokens": int}, ...]}.
"""

import argparse
import json
import os
import time
from collections import deque

import llama_cpp as lc

from hf_common import gguf_path, llama_cpp_build  # noqa: E402  (the script's folder is on sys.path)
from llamacpp_common import N_BATCH, Context, decode_prefix  # noqa: E402

# mode: (one stream?, kv_unified, prefix shared via seq_cp)
MODES = {"sequential": (True, False, False), "batched": (False, False, False), "batched_prefix": (False, True, True),
         "batched_unified": (False, True, False), "batched_prefix_copy": (False, False, True)}


class Slot:
    """One sequence id's request: prompt tokens not yet decoded, and the output so far."""

    def __init__(self, index: int, request: dict):
        self.index, self.prompt, self.max_tokens = index, request["prompt_ids"], request["max_tokens"]
        self.num_prompt_done = 0
        self.output: list[int] = []

    @property
    def in_prompt(self) -> bool:
        return self.num_prompt_done < len(self.prompt)


def _plan(slots: dict[int, Slot]) -> tuple[list[tuple[int, int, int, bool]], list[tuple[int, int]]]:
    """One llama_decode's entries: a token for each decoding slot first, then prompt chunks in slot order."""
    entries, owners = [], []  # owners: (sequence id, prompt tokens consumed) per entry
    for seq, slot in slots.items():
        if not slot.in_prompt:
            entries.append((slot.output[-1], len(slot.prompt) + len(slot.output) - 1, seq, True))
            owners.append((seq, 0))
    for seq, slot in slots.items():
        room = N_BATCH - len(entries)
        if slot.in_prompt and room > 0:
            chunk = slot.prompt[slot.num_prompt_done:slot.num_prompt_done + room]
            for offset, token in enumerate(chunk):
                last = slot.num_prompt_done + offset == len(slot.prompt) - 1
                entries.append((token, slot.num_prompt_done + offset, seq, last))
                owners.append((seq, 1))
    return entries, owners


def run(context: Context, requests: list[dict], parallel: int, shared_prefix: int = 0) -> list[list[int]]:
    """Continuous batching over `parallel` sequence ids (parallel = 1 is one sequential stream); with
    shared_prefix, that many leading tokens are decoded once (sequence id `parallel`) and copied."""
    waiting = deque(enumerate(requests))
    slots: dict[int, Slot] = {}
    outputs: list[list[int] | None] = [None] * len(requests)
    if shared_prefix:
        decode_prefix(context, requests[0]["prompt_ids"][:shared_prefix], parallel)
    while waiting or slots:
        for seq in range(parallel):
            if seq not in slots and waiting:
                slots[seq] = Slot(*waiting.popleft())
                if shared_prefix:
                    context.copy_prefix(parallel, seq)
                    slots[seq].num_prompt_done = shared_prefix
        entries, owners = _plan(slots)
        picks = iter(context.decode(entries))
        for (token, position, seq, logits), (owner, consumed) in zip(entries, owners):
            slot = slots[owner]
            slot.num_prompt_done += consumed
            if logits:
                slot.output.append(next(picks))
        for seq in [s for s, slot in slots.items() if len(slot.output) >= slot.max_tokens]:
            slot = slots.pop(seq)
            outputs[slot.index] = slot.output
            context.remove(seq)
    if shared_prefix:
        context.remove(parallel)
    return outputs


def run_mode(model, requests: list[dict], parallel: int, threads: int, repeats: int, shared_prefix: int = 0,
             unified: bool = False) -> tuple[dict, list[list[int]]]:
    context = Context(model, parallel, threads, unified)
    n_ctx = lc.llama_n_ctx(context.ctx)  # all sequence ids, the spare one included
    try:
        start = time.perf_counter()
        run(context, [{"prompt_ids": requests[0]["prompt_ids"][:16], "max_tokens": 4}] * parallel, parallel)
        warmup_s = time.perf_counter() - start
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            outputs = run(context, requests, parallel, shared_prefix)
            runs.append((time.perf_counter() - start, outputs))
    finally:
        context.close()
    seconds, outputs = min(runs, key=lambda run: run[0])
    num_output = sum(len(o) for o in outputs)
    return {"parallel": parallel, "kv_unified": unified, "shared_prefix": shared_prefix, "n_ctx": n_ctx, "n_batch": N_BATCH,
            "warmup_s": warmup_s, "seconds": seconds,
            "seconds_per_repeat": [run[0] for run in runs], "repeats_identical_tokens": all(run[1] == outputs for run in runs),
            "num_output_tokens": num_output, "output_tokens_per_s": num_output / seconds}, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True, help="JSON file: {mode: generated ids per request}")
    parser.add_argument("--parallel", type=int, default=16, help="sequence ids in batched mode")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--modes", default="sequential,batched", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="batched_prefix(_copy): leading tokens every request shares (fewer than any prompt has)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of the workload per mode; the best is reported")
    parser.add_argument("--gguf", default=None, help="a GGUF file to run (default: the embedded SmolLM2 GGUF)")
    args = parser.parse_args()

    with open(args.workload) as file:
        requests = json.load(file)["requests"]
    lc.llama_backend_init()
    start = time.perf_counter()
    model = lc.llama_model_load_from_file((args.gguf or gguf_path()).encode(), lc.llama_model_default_params())
    if not model:
        raise SystemExit("error: llama_model_load_from_file failed")
    load_s = time.perf_counter() - start
    modes, tokens = {}, {}
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"error: unknown mode {mode!r} (modes: {', '.join(MODES)})")
        single, unified, sharing = MODES[mode]
        parallel = 1 if single else args.parallel
        shared = args.shared_prefix if sharing else 0
        if sharing and not shared:
            raise SystemExit(f"error: {mode} needs --shared-prefix N > 0")
        if shared and any(r["prompt_ids"][:shared] != requests[0]["prompt_ids"][:shared] for r in requests):
            raise SystemExit("error: --shared-prefix tokens differ between requests")
        if shared and any(len(r["prompt_ids"]) <= shared for r in requests):
            raise SystemExit("error: --shared-prefix must be shorter than every prompt (its last token's logits are needed)")
        modes[mode], tokens[mode] = run_mode(model, requests, parallel, args.threads, args.repeats, shared, unified)
    lc.llama_model_free(model)
    with open(args.out, "w") as file:
        json.dump(tokens, file)
    print(json.dumps({"peer": "llama_cpp", "llama_cpp_python_version": lc.__version__, "threads": args.threads,
                      "system_info": lc.llama_print_system_info().decode(), "cmake_args": llama_cpp_build(), "load_s": load_s, "modes": modes}))


if __name__ == "__main__":
    main()
