"""Paged attention on the CPU: a C++ XLA FFI kernel (paged_attention.cc) and its jitted call.

The jnp path (jaxinfer/attention.py) gathers every page of a step into a new array and transposes it for
XLA:CPU's dot; this kernel reads the pages where they lie, in the pool's layout, with an online softmax
per query, and skips the pages a query cannot see (later positions, other sequences of a packed row).
The math is jaxinfer.attention.attention_over_pages, which stays the reference.

The source is compiled on first use with the machine's C++ compiler (`-O3 -march=native`), into a cache
keyed by the source, the flags, jaxlib's version and this CPU, so a home directory shared by different
machines never loads code built for another. Without a compiler, `available()` is False and the engine
keeps the jnp path.
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
import jax.numpy as jnp
import jaxlib
from jaxtyping import Array, Float, Int

SOURCE = Path(__file__).with_name("paged_attention.cc")
TARGET = "jaxinfer_paged_attention_cpu_f32"
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


def _library_path() -> Path:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS + LINK_FLAGS).encode(), jaxlib.__version__.encode(), _cpu_identity().encode()):
        digest.update(part)
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxinfer" / "kernels")
    return cache / f"paged_attention_cpu-{digest.hexdigest()[:16]}.so"


def _compile(out: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # build beside the target, then rename: atomic
        built, obj = Path(tmp) / out.name, Path(tmp) / "kernel.o"
        for cmd in ([compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", "-c", str(SOURCE), "-o", str(obj)], [compiler, *LINK_FLAGS, str(obj), "-o", str(built)]):
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, out)


@functools.cache
def available() -> bool:
    """Build (once per machine and source) and register the kernel; False, with a warning, if it cannot."""
    path = _library_path()
    try:
        if not path.exists():
            _compile(path)
        library = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.JaxinferPagedAttentionF32), platform="cpu")
    except (OSError, RuntimeError) as err:
        warnings.warn(f"the CPU paged-attention kernel is unavailable, using the jnp path: {err}", stacklevel=2)
        return False
    return True


def paged_attention(
    q: Float[Array, "B T H K"],
    k_pool: Float[Array, "N G P K L"],
    v_pool: Float[Array, "N G P L K"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "B M"],
    q_positions: Int[Array, "B T"],
    page_positions: Int[Array, "B M"] | None = None,
    page_segments: Int[Array, "B M"] | None = None,
    token_segments: Int[Array, "B T"] | None = None,
) -> Float[Array, "B T H K"]:
    """Causal GQA attention of `q` over `layer` of the pool, through each row's block table; f32 only.

    Without page_positions (one sequence per row), entry m of a table starts at position m * L. A query
    that sees no key (a padding lane) gets zeros."""
    if not available():
        raise RuntimeError("the CPU paged-attention kernel could not be built; see the warning above")
    b, m = block_tables.shape
    page_size = k_pool.shape[-1]
    if page_positions is None:
        page_positions = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32) * page_size, (b, m))
        page_segments = jnp.zeros((b, m), jnp.int32)
        token_segments = jnp.zeros(q_positions.shape, jnp.int32)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32), k_pool, v_pool, i32(layer), i32(block_tables), i32(page_positions), i32(page_segments),
        i32(q_positions), i32(token_segments),
    )
