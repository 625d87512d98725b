"""Build and register the C++ kernels of kernels_cpu/ on first use.

Each kernel is one `.cc` file (plus the shared headers here), compiled with the machine's C++ compiler
(`-O3 -march=native`) into a cache keyed by the sources, the flags, jaxlib's version and this CPU, so a
home directory shared by different machines never loads code built for another. Its FFI handlers are
registered with XLA for the CPU platform. Without a compiler, `load` returns False with a warning and
the callers keep their jnp paths.
"""

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jaxlib

HERE = Path(__file__).parent
# -ffast-math only when compiling: linked with it, the library would set flush-to-zero for the whole process.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC")
LINK_FLAGS = ("-shared",)
CACHE_ENV = "JAXINFER_KERNEL_CACHE"  # where built kernels go; default ~/.cache/jaxinfer/kernels


def _cpu_identity() -> str:
    """The CPU model and feature flags, which -march=native compiles for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def library_path(source: Path) -> Path:
    digest = hashlib.sha256()
    for part in (source.read_bytes(), *(h.read_bytes() for h in sorted(HERE.glob("*.h"))), " ".join(FLAGS + LINK_FLAGS).encode(),
                 jaxlib.__version__.encode(), _cpu_identity().encode()):
        digest.update(part)
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxinfer" / "kernels")
    return cache / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def sources_digest() -> str:
    """A digest of every kernel source and header here: part of the tuner's cache key, so a changed kernel
    is timed again instead of inheriting the choice its predecessor won."""
    digest = hashlib.sha256()
    for path in sorted((*HERE.glob("*.cc"), *HERE.glob("*.h"))):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _compile(source: Path, out: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # build beside the target, then rename: atomic
        built, obj = Path(tmp) / out.name, Path(tmp) / "kernel.o"
        include = [f"-I{jax.ffi.include_dir()}", f"-I{HERE}"]
        for cmd in ([compiler, *FLAGS, *include, "-c", str(source), "-o", str(obj)], [compiler, *LINK_FLAGS, str(obj), "-o", str(built)]):
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, out)


@functools.cache
def load(source_name: str, targets: tuple[tuple[str, str], ...]) -> bool:
    """Build `source_name` (once per machine and source) and register each (FFI target, C symbol) of
    `targets`; False, with a warning, if it cannot."""
    source = HERE / source_name
    path = library_path(source)
    try:
        if not path.exists():
            _compile(source, path)
        library = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in targets:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as err:
        warnings.warn(f"the CPU kernel {source_name} is unavailable, using the jnp path: {err}", stacklevel=3)
        return False
    return True
