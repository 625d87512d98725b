"""Fetch llama.cpp's vocabulary-only GGUFs, their reference tokenizations and chat templates.

They ship in the llama-cpp-python source distribution on the package index (vendor/llama.cpp/models).
The sdist (~77 MB) is fetched once with `pip download` (pip's own cache serves repeats) into OUT, and
only the files the tests read are unpacked, into OUT/models. Nothing but the package index is used.

    python tests/reference/fetch_llama_cpp_models.py --out build/llama-cpp-python
"""

import argparse
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
VOCABS = ("llama-spm", "llama-bpe", "qwen2", "phi-3", "gemma-4", "qwen35")  # qwen35: a pre-tokenizer jaxinfer refuses
_PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/"


def _wanted(name: str) -> bool:
    rest = name.removeprefix(_PREFIX)
    if rest == name:
        return False
    return rest.startswith("templates/") or any(rest.startswith(f"ggml-vocab-{v}.gguf") for v in VOCABS)


def fetch(out: Path) -> Path:
    """OUT/models with the vocab files and templates; downloads the sdist only when it is not in OUT. An
    extraction made for another VOCABS list (its .complete names them) is redone."""
    out.mkdir(parents=True, exist_ok=True)
    models = out / "models"
    stamp = f"llama-cpp-python {VERSION}\nvocabs: {' '.join(VOCABS)}\n"
    if (models / ".complete").is_file() and (models / ".complete").read_text() == stamp:
        (models / ".complete").touch()  # up to date, for make's timestamps too
        return models
    sdist = out / SDIST
    if not sdist.is_file():
        command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet",
                   "--no-binary", ":all:", "--no-deps", f"llama-cpp-python=={VERSION}", "-d", str(out)]
        subprocess.run(command, check=True)
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            if member.isfile() and _wanted(member.name):
                target = models / member.name.removeprefix(_PREFIX)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.extractfile(member).read())
    (models / ".complete").write_text(stamp)
    return models


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("build/llama-cpp-python"))
    print(fetch(parser.parse_args(argv).out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
