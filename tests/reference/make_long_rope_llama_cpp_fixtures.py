"""llama.cpp's own logits on the long-context rope GGUFs (tests/long_rope_gguf.py), committed as a fixture.

Needs the benchmark environment (`make setup-bench`: llama-cpp-python 0.3.36 in .venv-ref):

    .venv-ref/bin/python tests/reference/make_long_rope_llama_cpp_fixtures.py --out tests/fixtures

Writes OUT/llama_cpp_long_rope_logits.npz: keys <name>_s<i>_logits, float32[T, vocab], for tiny_phi3 and
tiny_qwen2_yarn on the sequences of their transformers fixtures, evaluated with n_ctx 256 (past the original
context of 32) and an f32 KV cache. tiny_qwen3_yarn is left out: llama.cpp reads no yarn_beta_* or
yarn_log_multiplier key for qwen3, so it runs other frequencies than the file (and transformers) say.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: long_rope_gguf, gguf_convert

MODELS = ("tiny_phi3", "tiny_qwen2_yarn")
N_CTX = 256


def long_rope_logits(work: Path) -> dict[str, np.ndarray]:
    import llama_cpp
    import long_rope_gguf

    arrays = {}
    for name in MODELS:
        path = work / f"{name}.gguf"
        if name == "tiny_phi3":
            long_rope_gguf.phi3_gguf(path, no_vocab=True)
        else:
            long_rope_gguf.yarn_gguf(name, path, no_vocab=True)
        data = np.load(long_rope_gguf.FIXTURES / f"{name}_reference.npz")
        model = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_batch=N_CTX, logits_all=True, verbose=False,
                                n_threads=2, type_k=0, type_v=0)  # GGML_TYPE_F32 cache: no f16 rounding of K/V
        for s in range(int(data["num_sequences"])):
            ids = data[f"s{s}_ids"].tolist()
            model.reset()
            model.eval(ids)
            arrays[f"{name}_s{s}_logits"] = np.array(model.scores[: len(ids)], np.float32)  # a copy: eval overwrites scores
            print(f"  {name} s{s} T={len(ids)}", flush=True)
    return arrays


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from make_fixtures import write_npz

    with tempfile.TemporaryDirectory() as work:
        write_npz(args.out / "llama_cpp_long_rope_logits.npz", long_rope_logits(Path(work)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
