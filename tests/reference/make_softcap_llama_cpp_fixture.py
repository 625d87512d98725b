"""llama.cpp's own logits (llama-cpp-python 0.3.36) on the tiny soft-capped Gemma 2 GGUF, committed as a fixture.

Needs the benchmark environment (`make setup-bench`), so it is not part of `make test`:

    .venv-ref/bin/python tests/reference/make_softcap_llama_cpp_fixture.py --out tests/fixtures

Writes tiny_gemma2_softcap_llama_cpp.npz (s<i>_logits float32[T, vocab]) exactly as make_gemma_llama_cpp_fixtures.py
does for tiny_gemma2: the GGUF tests/gemma_gguf.py writes from the folder (attn_logit_softcapping 1.0 included),
evaluated with an f32 KV cache, one batch per sequence. llama.cpp applies the cap in its own attention
(llama-graph.cpp, build_attn_mha: kq = tanh(kq * kq_scale / cap) * cap before the mask).
"""

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAME = "tiny_gemma2_softcap"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="fixtures directory (holds the tiny_gemma2_softcap folder)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from make_fixtures import write_npz
    from make_gemma_llama_cpp_fixtures import gemma_logits

    with tempfile.TemporaryDirectory() as work:
        write_npz(args.out / f"{NAME}_llama_cpp.npz", gemma_logits(args.out, Path(work), NAME))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
