"""Build and register the C++ kernels of kernels_cpu/ on first use; owns jaxinfer's cache root.

`cache_root()` is the one rule for where jaxinfer caches anything: $JAXINFER_CACHE_DIR, else
$XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer. The kernels go under `<root>/kernels` (or
$JAXINFER_KERNEL_CACHE, which names the kernels' folder alone), the tuner's cache and the XLA programs
(`<root>/xla`) are placed by their owners from the same root.

Each kernel is one `.cc` file (plus the shared headers here), compiled with the machine's C++ compiler
(`-O3 -march=native`) into a cache keyed by the sources, the flags, jaxlib's version and this CPU, so a
home directory shared by different machines never loads code built for another. Beside each library
lies `<library>.sha256`, its name, size and SHA-256 written at build time; a cached library is loaded
only if it matches them (a truncated or foreign file never reaches dlopen), else, or if loading it fails,
it is rebuilt once. Library and digest are written under temporary names, fsynced, then renamed into
place. An unwritable cache builds into a temporary folder for this process, with one warning. Its FFI
handlers are registered with XLA for the CPU platform. Whatever fails (no compiler, a failed build or
load), `load` returns False with one warning and the callers keep their jnp paths; it never raises.

Imports jax and the standard library only; never jaxinfer (jaxinfer imports this module).
"""

import atexit
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
CACHE_ROOT_ENV = "JAXINFER_CACHE_DIR"  # the root of every jaxinfer cache (see cache_root)
CACHE_ENV = "JAXINFER_KERNEL_CACHE"  # the kernels' folder alone; default <cache root>/kernels
DIGEST_SUFFIX = ".sha256"  # beside each library: "<name> <size in bytes> <sha256 hex>"


def cache_root() -> Path:
    """$JAXINFER_CACHE_DIR, else $XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer: the one rule for every
    jaxinfer cache (kernels, tuning, XLA programs). The folder may not exist, or be unwritable."""
    if os.environ.get(CACHE_ROOT_ENV):
        return Path(os.environ[CACHE_ROOT_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "jaxinfer"


def kernel_dir() -> Path:
    """Where built kernels are cached: $JAXINFER_KERNEL_CACHE, else <cache root>/kernels."""
    return Path(os.environ[CACHE_ENV]).expanduser() if os.environ.get(CACHE_ENV) else cache_root() / "kernels"


def _cpu_identity() -> str:
    """The CPU model and feature flags, which -march=native compiles for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo names none)."""
    return set(" ".join(line.split(":", 1)[-1] for line in _cpu_identity().splitlines() if line.startswith("flags")).split())


def has_int8_vector_path() -> bool:
    """Whether this CPU has the quantized kernels' vector path (w8a8.h: AVX-512 F, BW and VNNI, which -march=native
    then compiles in). Without it their int8 dots are scalar loops: on an AMD EPYC with AVX2 only, the tuner's
    224-token probe prefill took 20.7 s through them against 0.37 s through XLA's dense matmul."""
    return {"avx512f", "avx512bw", "avx512_vnni"} <= _cpu_flags()


def has_matmul_vector_path() -> bool:
    """Whether this CPU has the layer-matmul kernel's wide path (layer_matmul.cc: 16-float vectors, 6-row tiles under
    AVX-512 F). Without it the kernel's 8-float AVX2 tiles lose to XLA's dot: on an AMD EPYC with AVX2 only, SmolLM2
    generated 4 prompts of 60-290 tokens, 20 tokens each, in 9.2 s through the kernel against 2.1 s through XLA, and
    4 short prompts, 100 tokens each, in 16.2 s against 5.6 s."""
    return "avx512f" in _cpu_flags()


def library_path(source: Path) -> Path:
    digest = hashlib.sha256()
    for part in (source.read_bytes(), *(h.read_bytes() for h in sorted(HERE.glob("*.h"))), " ".join(FLAGS + LINK_FLAGS).encode(),
                 jaxlib.__version__.encode(), _cpu_identity().encode()):
        digest.update(part)
    return kernel_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def sources_digest() -> str:
    """A digest of every kernel source and header here: part of the tuner's cache key, so a changed kernel
    is timed again instead of inheriting the choice its predecessor won."""
    digest = hashlib.sha256()
    for path in sorted((*HERE.glob("*.cc"), *HERE.glob("*.h"))):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def digest_path(library: Path) -> Path:
    return library.with_name(library.name + DIGEST_SUFFIX)


def _digest_line(library: Path, name: str) -> str:
    """What the digest file of `library` holds once it is installed as `name`."""
    data = library.read_bytes()
    return f"{name} {len(data)} {hashlib.sha256(data).hexdigest()}\n"


def verified(library: Path) -> bool:
    """Whether `library` is the file its build wrote: its digest file names it, and its size (checked
    first, so a truncated library is never read whole) and SHA-256 match."""
    try:
        recorded = digest_path(library).read_text()
        name, size, _ = recorded.split()
        if name != library.name or library.stat().st_size != int(size):
            return False
        return _digest_line(library, library.name) == recorded
    except (OSError, ValueError):
        return False


def _compiler() -> str:
    """$CXX (a name on PATH or a path), else g++, c++ or clang++ on PATH; RuntimeError naming what is missing."""
    if os.environ.get("CXX"):
        found = shutil.which(os.environ["CXX"])
        if found is None:
            raise RuntimeError(f"the C++ compiler CXX={os.environ['CXX']!r} is not an executable")
        return found
    found = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if found is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    return found


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _compile(source: Path, out: Path) -> None:
    """Compile `source` into the library `out`, with its digest file: both are built under temporary
    names beside `out`, fsynced, and renamed into place (the library first), so a crash or power cut
    leaves the old files or whole new ones, never an empty one."""
    compiler = _compiler()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built, obj, digest = Path(tmp) / out.name, Path(tmp) / "kernel.o", Path(tmp) / "digest"
        include = [f"-I{jax.ffi.include_dir()}", f"-I{HERE}"]
        for cmd in ([compiler, *FLAGS, *include, "-c", str(source), "-o", str(obj)], [compiler, *LINK_FLAGS, str(obj), "-o", str(built)]):
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        digest.write_text(_digest_line(built, out.name))
        for path in (built, digest):
            _fsync(path)
        os.replace(built, out)
        os.replace(digest, digest_path(out))
        _fsync(out.parent)


@functools.cache
def _process_dir() -> Path:
    """A folder of this process's own, removed at exit: where kernels are built when the cache is unwritable."""
    path = Path(tempfile.mkdtemp(prefix="jaxinfer-kernels-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _writable(folder: Path) -> OSError | None:
    """None if files can be created in `folder` (made if missing), else the error that says why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as err:
        return err


@functools.cache
def _build_dir(cache: Path) -> Path:
    """`cache` if it is writable, else this process's folder, with one warning (once per folder)."""
    if (err := _writable(cache)) is None:
        return cache
    fallback = _process_dir()
    warnings.warn(f"the kernel cache {cache} is not writable ({err}); building the CPU kernels into {fallback} for this process only",
                  stacklevel=5)  # the kernel module's available()
    return fallback


def _open(path: Path, symbols: tuple[str, ...]) -> list:
    """dlopen `path` and look up `symbols`; a library without them is closed again (so a rebuilt file at
    the same path is opened anew, not the cached handle) and AttributeError raised."""
    library = ctypes.CDLL(str(path))
    try:
        return [getattr(library, symbol) for symbol in symbols]
    except AttributeError:
        import _ctypes  # noqa: PLC0415  (POSIX dlclose; only on this failure)

        _ctypes.dlclose(library._handle)
        raise


def _functions(source: Path, symbols: tuple[str, ...]) -> list:
    """The C functions `symbols` of `source`'s library: the cached one if it is verified and loads, else
    built once more (into the cache, or this process's folder if the cache is unwritable) and loaded."""
    path = library_path(source)
    if verified(path):
        try:
            return _open(path, symbols)
        except (OSError, AttributeError):
            pass  # a verified library that does not load: rebuilt below
    target = _build_dir(path.parent) / path.name
    _compile(source, target)
    return _open(target, symbols)


@functools.cache
def load(source_name: str, targets: tuple[tuple[str, str], ...]) -> bool:
    """Build `source_name` (once per machine and source) and register each (FFI target, C symbol) of
    `targets`; False, with a warning, if it cannot."""
    try:
        functions = _functions(HERE / source_name, tuple(symbol for _, symbol in targets))
        for (target, _), function in zip(targets, functions):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(function), platform="cpu")
    except (OSError, RuntimeError, AttributeError, ValueError) as err:
        warnings.warn(f"the CPU kernel {source_name} is unavailable, using the jnp path: {err}", stacklevel=3)
        return False
    return True
