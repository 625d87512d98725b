"""llama.cpp's own logits (llama-cpp-python 0.3.36) on the tiny Gemma 2 and Gemma 3 GGUFs, committed as fixtures.

Needs the benchmark environment (`make setup-bench`), so it is not part of `make test`:

    .venv-ref/bin/python tests/reference/make_gemma_llama_cpp_fixtures.py --out tests/fixtures

For each of tiny_gemma2 and tiny_gemma3, writes <name>_llama_cpp.npz with s<i>_logits float32[T, vocab]: the
logits llama.cpp (f32 KV cache, one batch per sequence) gives on the GGUF that tests/gemma_gguf.py writes from
the folder, for the sequences of <name>_reference.npz. llama.cpp scales queries by head_dim ** -0.5 (a GGUF
cannot carry query_pre_attn_scalar, 24 in these models), so these differ from transformers' logits by that;
the relative error against transformers is printed only as a reading.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
NAMES = ("tiny_gemma2", "tiny_gemma3")


def gemma_logits(fixtures: Path, work: Path, name: str) -> dict[str, np.ndarray]:
    import llama_cpp

    sys.path.insert(0, str(HERE.parent))
    from gemma_gguf import gemma_gguf

    path = gemma_gguf(fixtures / name, work / f"{name}.gguf", no_vocab=True)
    model = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, n_ubatch=256, logits_all=True, verbose=False,
                            n_threads=2, type_k=0, type_v=0)  # GGML_TYPE_F32 cache: no f16 rounding of K/V
    reference = np.load(fixtures / f"{name}_reference.npz")
    arrays, errors = {}, []
    for s in range(int(reference["num_sequences"])):
        ids, expected = reference[f"s{s}_ids"].tolist(), reference[f"s{s}_logits"].astype(np.float64)
        model.reset()
        model.eval(ids)
        got = np.array(model.scores[: len(ids)], np.float32)  # a copy: the next eval overwrites scores
        arrays[f"s{s}_logits"] = got
        errors.append(float(np.linalg.norm(got - expected) / np.linalg.norm(expected)))
    print(f"  {name}: llama.cpp vs transformers (query scale differs), relative error per sequence: "
          + ", ".join(f"{e:.2e}" for e in errors), flush=True)
    return arrays


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="fixtures directory (holds the tiny_gemma folders)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from make_fixtures import write_npz

    with tempfile.TemporaryDirectory() as work:
        for name in NAMES:
            write_npz(args.out / f"{name}_llama_cpp.npz", gemma_logits(args.out, Path(work), name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
