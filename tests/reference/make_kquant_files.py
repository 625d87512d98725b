"""K-quant GGUF test files made by llama.cpp's own quantizer, with llama.cpp's logits as the reference.

Needs the benchmark environment (`make setup-bench`: .venv-ref with llama-cpp-python built from source), so
it is not part of `make test`; its output is committed under tests/fixtures/kquant/ (`make kquant-fixtures`):

    .venv-ref/bin/python tests/reference/make_kquant_files.py --out tests/fixtures/kquant

1. A tiny random Llama (3 layers, D 256, 4 query / 2 kv heads of 64, MLP 256, 256 token ids, an untied head,
   no vocabulary: tokenizer.ggml.model "none") is written in F32 with gguf-py (build/, not committed).
2. `llama_cpp.llama_model_quantize` (llama.cpp's quantizer, the one `llama-quantize` runs) writes it as
   Q4_K_M, Q5_K_M and Q6_K. With 3 layers Q4_K_M / Q5_K_M keep attn_v and ffn_down in Q6_K in layer 2 only
   (llama.cpp's use_more_bits), so those weights mix types across layers; the head is Q6_K.
3. llama.cpp evaluates SEQUENCES on each file (f32 KV cache, logits for every position) and continues each
   greedily for GREEDY_TOKENS tokens.

Writes OUT/<type>.gguf for each type, and OUT/reference.npz: <type>_s<i>_ids (int32[T]), <type>_s<i>_logits
(float32[T, V]), <type>_s<i>_greedy (int32[GREEDY_TOKENS]), <type>_tensor_types (the file's tensor name=type
lines, for the record).
"""

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
GEOMETRY = dict(num_layers=3, embed_dim=256, num_heads=4, num_kv_heads=2, ffn_dim=256, vocab_size=256, context=256)
WEIGHT_STD = 0.08  # larger than an initializer's 0.02, so the tiny model's next-token distributions are not flat
TYPES = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}
NUM_SEQUENCES, SEQUENCE_LENGTH, GREEDY_TOKENS = 3, 16, 8


def write_f32(path: Path, seed: int = 0) -> None:
    """The tiny random Llama in F32 (llama.cpp's tensor names and [out, in] rows, Q/K as its converter writes them)."""
    import gguf

    g = GEOMETRY
    head_dim = g["embed_dim"] // g["num_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny random llama for K-quant tests")
    writer.add_block_count(g["num_layers"])
    writer.add_context_length(g["context"])
    writer.add_embedding_length(g["embed_dim"])
    writer.add_feed_forward_length(g["ffn_dim"])
    writer.add_head_count(g["num_heads"])
    writer.add_head_count_kv(g["num_kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("none")  # token ids only; llama.cpp sizes the embedding from vocab_size
    writer.add_vocab_size(g["vocab_size"])
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * WEIGHT_STD).astype(np.float32)

    d, f, v, kv = g["embed_dim"], g["ffn_dim"], g["vocab_size"], g["num_kv_heads"] * head_dim
    writer.add_tensor("token_embd.weight", matrix(v, d))
    for i in range(g["num_layers"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", matrix(d, d))
        writer.add_tensor(f"blk.{i}.attn_k.weight", matrix(kv, d))
        writer.add_tensor(f"blk.{i}.attn_v.weight", matrix(kv, d))
        writer.add_tensor(f"blk.{i}.attn_output.weight", matrix(d, d))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(f, d))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", matrix(f, d))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", matrix(d, f))
    writer.add_tensor("output_norm.weight", np.ones(d, np.float32))
    writer.add_tensor("output.weight", matrix(v, d))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(source: Path, target: Path, ftype: str, threads: int = 2) -> None:
    """`source` -> `target` by llama.cpp's quantizer (llama_model_quantize, its default parameters)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source.name} -> {ftype}) returned {status}")


def tensor_types(path: Path) -> list[str]:
    import gguf

    return [f"{t.name}={t.tensor_type.name}" for t in gguf.GGUFReader(str(path)).tensors]


def sequences(seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, GEOMETRY["vocab_size"], SEQUENCE_LENGTH).tolist() for _ in range(NUM_SEQUENCES)]


def reference(path: Path, name: str) -> dict[str, np.ndarray]:
    """llama.cpp's logits for every position of each sequence, and its greedy continuation (f32 KV cache)."""
    import llama_cpp

    model = llama_cpp.Llama(model_path=str(path), n_ctx=GEOMETRY["context"], n_batch=GEOMETRY["context"], logits_all=True,
                            verbose=False, n_threads=2, type_k=0, type_v=0)  # GGML_TYPE_F32 cache
    arrays = {}
    for s, ids in enumerate(sequences()):
        model.reset()
        model.eval(ids)
        arrays[f"{name}_s{s}_ids"] = np.asarray(ids, np.int32)
        arrays[f"{name}_s{s}_logits"] = np.array(model.scores[: len(ids)], np.float32)
        greedy = []
        for _ in range(GREEDY_TOKENS):
            token = int(np.argmax(model.scores[model.n_tokens - 1]))
            greedy.append(token)
            model.eval([token])
        arrays[f"{name}_s{s}_greedy"] = np.asarray(greedy, np.int32)
    return arrays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "kquant")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "kquant_files", help="where the F32 source is written")
    parser.add_argument("--quantize", nargs=3, metavar=("SOURCE", "TARGET", "TYPE"),
                        help=f"only quantize SOURCE (an F32/F16 GGUF) to TARGET as TYPE ({', '.join(TYPES)}) and exit (experiments/bench_kquant.py)")
    args = parser.parse_args(argv)
    if args.quantize:
        source, target, kind = args.quantize
        quantize(Path(source), Path(target), TYPES[kind.lower()])
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    source = args.work / "tiny_llama_f32.gguf"
    write_f32(source)
    arrays = {}
    for name, ftype in TYPES.items():
        target = args.out / f"{name}.gguf"
        quantize(source, target, ftype)
        types = tensor_types(target)
        arrays[f"{name}_tensor_types"] = np.asarray(types)
        kinds = sorted({t.split("=")[1] for t in types})
        print(f"  {name}: {target.stat().st_size / 1e6:.2f} MB, tensor types {', '.join(kinds)}", flush=True)
        arrays |= reference(target, name)
    sys.path.insert(0, str(HERE))
    from make_fixtures import write_npz  # fixed zip timestamps, as for every npz fixture

    write_npz(args.out / "reference.npz", arrays)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
