"""llama.cpp peer of experiments/kquant_perplexity.py: its quantizer, and its perplexity on windows of a text.

Runs only in the reference env (.venv-ref, llama-cpp-python from `make setup-bench`); kquant_perplexity.py
starts it as a subprocess. Two commands, each printing one JSON document as its last stdout line:

    quantize SOURCE TARGET FTYPE   llama_model_quantize (the quantizer `llama-quantize` runs, its default
                                   parameters) writes SOURCE (an F32 GGUF) as FTYPE (a LLAMA_FTYPE_MOSTLY_*
                                   name); answers the seconds and the count of each tensor type written.
    score MODEL TEXT --window W --num-windows N [--kv-types f16,f32]
                                   llama.cpp tokenizes TEXT (no BOS, no special-token parsing) and answers
                                   the ids, so the caller can check its own tokenizer made the same ones.
                                   Windows are ids[i*W:(i+1)*W] for i < N, the first token replaced by BOS
                                   where the vocabulary adds one (llama-perplexity's rule). Each window is
                                   one llama_eval with logits for every position (logits_all), in a fresh
                                   context of W cells with the KV cache of each --kv-types entry (f16:
                                   llama.cpp's default). As llama-perplexity, the second half is scored:
                                   positions W/2 .. W-2 predict tokens W/2+1 .. W-1, log-softmax in float64.
                                   Answers each scored token's log-probability per window and KV type.
"""

import argparse
import json
import os
import time

import llama_cpp as lc
import numpy as np

KV_TYPES = {"f16": lc.GGML_TYPE_F16, "f32": lc.GGML_TYPE_F32}


def quantize(source: str, target: str, ftype: str, threads: int) -> dict:
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, ftype)
    params.nthread = threads
    start = time.perf_counter()
    status = lc.llama_model_quantize(source.encode(), target.encode(), params)
    if status != 0:
        raise SystemExit(f"error: llama_model_quantize({source} -> {ftype}) returned {status}")
    import gguf  # the reference env's gguf-py, to list what the quantizer wrote

    types: dict[str, int] = {}
    for tensor in gguf.GGUFReader(target).tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    return {"seconds": time.perf_counter() - start, "ftype": ftype, "tensor_types": types, "bytes": os.path.getsize(target)}


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis of float32 [T, V] logits."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def windows_of(ids: list[int], window: int, num_windows: int, bos: int | None) -> list[list[int]]:
    """The first `num_windows` non-overlapping windows of `ids`, each led by `bos` where given."""
    out = [list(ids[i * window:(i + 1) * window]) for i in range(num_windows)]
    if bos is not None:
        for w in out:
            w[0] = bos
    return out


def scored_logprobs(model: "lc.Llama", window: list[int]) -> list[float]:
    """log P(window[t + 1] | window[:t + 1]) for t in W/2 .. W-2, from one evaluation of the whole window."""
    model.reset()
    model.eval(window)
    logits = np.asarray(model.scores[: len(window)], np.float32)  # [W, V]
    first = len(window) // 2
    rows = log_softmax64(logits[first:len(window) - 1])  # [W - 1 - first, V]
    return rows[np.arange(rows.shape[0]), window[first + 1:]].tolist()


def score(path: str, text: str, window: int, num_windows: int, kv_types: list[str], threads: int) -> dict:
    result = {"kv_types": {}}
    for name in kv_types:
        model = lc.Llama(model_path=path, n_ctx=window, n_batch=window, n_ubatch=window, logits_all=True, n_threads=threads,
                         n_threads_batch=threads, type_k=KV_TYPES[name], type_v=KV_TYPES[name], verbose=False)
        if "ids" not in result:
            ids = model.tokenize(text.encode(), add_bos=False, special=False)
            add_bos = bool(lc.llama_vocab_get_add_bos(model._model.vocab))
            result |= {"ids": ids, "add_bos": add_bos, "bos": model.token_bos(), "n_vocab": model.n_vocab()}
            if len(ids) < window * num_windows:
                raise SystemExit(f"error: the text has {len(ids)} tokens, fewer than {num_windows} windows of {window}")
        start = time.perf_counter()
        wins = windows_of(result["ids"], window, num_windows, result["bos"] if result["add_bos"] else None)
        result["kv_types"][name] = {"logprobs": [scored_logprobs(model, w) for w in wins], "seconds": time.perf_counter() - start,
                                    "flash_attn": model.context_params.flash_attn_type if hasattr(model.context_params, "flash_attn_type") else None}
        model.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("source")
    q.add_argument("target")
    q.add_argument("ftype", help="a LLAMA_FTYPE_MOSTLY_* name")
    s = sub.add_parser("score")
    s.add_argument("model")
    s.add_argument("text")
    s.add_argument("--window", type=int, required=True)
    s.add_argument("--num-windows", type=int, required=True)
    s.add_argument("--kv-types", default="f16,f32")
    for p in (q, s):
        p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    lc.llama_backend_init()
    if args.command == "quantize":
        doc = quantize(args.source, args.target, args.ftype, args.threads)
    else:
        kv_types = args.kv_types.split(",")
        unknown = sorted(set(kv_types) - set(KV_TYPES))
        if unknown:
            raise SystemExit(f"error: unknown KV types {unknown} (types: {', '.join(KV_TYPES)})")
        text = open(args.text, encoding="utf-8").read()
        doc = score(args.model, text, args.window, args.num_windows, kv_types, args.threads)
    print(json.dumps({"peer": "llama_cpp", "llama_cpp_python_version": lc.__version__, "threads": args.threads, **doc}))


if __name__ == "__main__":
    main()
