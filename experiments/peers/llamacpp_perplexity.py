"""llama.cpp peer of experiments/bench_quant.py: logits for perplexity, and forward speed, on our token ids.

Runs only in the reference env (.venv-ref, llama-cpp-python from `make setup-bench`); bench_quant.py starts
it as a subprocess. Same Q4_1 GGUF as jaxinfer, computed the llama.cpp way (quantized weights, activations
rounded to q8_1 for the dot products), with a KV cache of each --kv-types entry (f16: llama.cpp's default;
q8_0: its 8-bit cache, one scale per 32 values). Flash attention is on for every type (llama.cpp needs it
for a quantized V cache), so the cache type is the only difference between them. Per type: every window's
logits at every position, saved for bench_quant.py to score with the code that scores jaxinfer
(dump_logits); prefill of --prefill-ids as one llama_decode; decode at each --batch-sizes over --context
keys, as in bench_forward.py's decode (time_decode). Each timing is the median of --repeats calls after 2
untimed ones. Prints one JSON document as its last stdout line.

    .venv-ref/bin/python experiments/peers/llamacpp_perplexity.py --windows W.json --logits-dir D \
        --prefill-ids P.json [--kv-types f16,q8_0] [--batch-sizes 1,8,32] [--context 512] [--repeats 5]
"""

import argparse
import json
import os
import pathlib
import statistics
import time

import llama_cpp as lc
import numpy as np

from hf_common import gguf_path, llama_cpp_build
from llamacpp_common import Context, decode_prefix

KV_TYPES = {"f16": lc.GGML_TYPE_F16, "q8_0": lc.GGML_TYPE_Q8_0}


class KVTypeContext(Context):
    """llamacpp_common.Context with a chosen KV cache type and flash attention on, `n_seq_max` sequence
    ids in one unified KV buffer (MAX_CONTEXT cells each, Context's sizing)."""

    def __init__(self, model, kv_type: int, n_seq_max: int, threads: int):
        super().__init__(model, n_seq_max - 1, threads, unified=True,  # Context adds one sequence id
                         type_k=kv_type, type_v=kv_type, flash_attn_type=lc.LLAMA_FLASH_ATTN_TYPE_ENABLED)

    def all_logits(self, num_rows: int) -> np.ndarray:
        """float32 [num_rows, V]: the logits of the last decode's rows that asked for them, in batch order."""
        return np.ctypeslib.as_array(lc.llama_get_logits(self.ctx), shape=(num_rows, self.n_vocab)).copy()


def dump_logits(context: KVTypeContext, windows: list[list[int]], out_dir: pathlib.Path, prefix: str) -> float:
    """Each window in a fresh sequence 0, logits at every position, saved as out_dir/{prefix}w{i}.npy
    (float32 [T, V]); bench_quant.py scores them exactly as it scores jaxinfer's. Returns the seconds."""
    start = time.perf_counter()
    for i, window in enumerate(windows):
        context.remove(0)
        context.decode([(token, position, 0, True) for position, token in enumerate(window)])
        np.save(out_dir / f"{prefix}w{i}.npy", context.all_logits(len(window)))
    return time.perf_counter() - start


def _median_seconds(call, repeats: int) -> tuple[float, list[float]]:
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def time_prefill(context: KVTypeContext, ids: list[int], repeats: int) -> dict:
    def call():
        context.remove(0)
        context.decode([(t, p, 0, p == len(ids) - 1) for p, t in enumerate(ids)])

    seconds, times = _median_seconds(call, repeats)
    return {"tokens": len(ids), "median_s": seconds, "times_s": times, "tokens_per_s": len(ids) / seconds}


def time_decode(model, kv_type: int, batch: int, prefix: list[int], threads: int, repeats: int) -> dict:
    """B rows at position len(prefix) over a shared prefix of context - 1 cells (decoded once, given to every
    sequence by seq_cp in one unified KV buffer), one token per sequence per llama_decode; the step's cells
    are removed after each call."""
    context = KVTypeContext(model, kv_type, batch, threads)
    try:
        decode_prefix(context, prefix, 0)
        for seq in range(1, batch):
            context.copy_prefix(0, seq)
        position = len(prefix)

        def call():
            context.decode([(prefix[-1], position, seq, True) for seq in range(batch)])
            for seq in range(batch):
                lc.llama_memory_seq_rm(context.memory, seq, position, -1)

        seconds, times = _median_seconds(call, repeats)
    finally:
        context.close()
    return {"batch": batch, "context": position + 1, "median_step_s": seconds, "times_s": times, "tokens_per_s": batch / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", required=True, help="JSON list of token-id lists")
    parser.add_argument("--logits-dir", type=pathlib.Path, required=True, help="where each window's logits go: {kv type}_w{i}.npy")
    parser.add_argument("--prefill-ids", required=True, help="JSON list of token ids (the prefill sequence)")
    parser.add_argument("--kv-types", default="f16,q8_0", help=f"comma list of {', '.join(KV_TYPES)}")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--context", type=int, default=512, help="keys each decode row attends to")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    windows = json.loads(pathlib.Path(args.windows).read_text())
    prefill_ids = json.loads(pathlib.Path(args.prefill_ids).read_text())
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(gguf_path().encode(), lc.llama_model_default_params())
    if not model:
        raise SystemExit("error: llama_model_load_from_file failed")
    results = {}
    for name in args.kv_types.split(","):
        if name not in KV_TYPES:
            raise SystemExit(f"error: unknown KV type {name!r} (types: {', '.join(KV_TYPES)})")
        context = KVTypeContext(model, KV_TYPES[name], 1, args.threads)
        try:
            entry = {"logits_s": dump_logits(context, windows, args.logits_dir, f"{name}_"), "prefill": time_prefill(context, prefill_ids, args.repeats)}
        finally:
            context.close()
        prefix = prefill_ids[: args.context - 1]
        entry["decode"] = [time_decode(model, KV_TYPES[name], int(b), prefix, args.threads, args.repeats) for b in args.batch_sizes.split(",")]
        results[name] = entry
    lc.llama_model_free(model)
    print(json.dumps({"peer": "llama_cpp", "llama_cpp_python_version": lc.__version__, "threads": args.threads, "gguf": os.path.basename(gguf_path()),
                      "system_info": lc.llama_print_system_info().decode(), "cmake_args": llama_cpp_build(), "kv_types": results}))


if __name__ == "__main__":
    main()
