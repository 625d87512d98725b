"""The CPU kernels' cache (kernels_cpu/build.py): a cached library that is damaged (random bytes, empty,
another kernel's library, truncated) is rebuilt before it reaches dlopen; an unwritable cache builds into a
folder of the process's own with one warning; no compiler leaves the kernel unavailable with one warning.
None of them kills the process.

A loaded library stays loaded for the life of its process, so every case runs the kernel loader in a fresh
subprocess whose cache root (JAXINFER_CACHE_DIR) and temporary folder (TMPDIR) are tmp folders of the test.
"""

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_cpu import build

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("cpu_kernels")  # skipped without a compiler; under CI=true, failed

PROBE = """
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from kernels_cpu import layer_matmul, paged_attention
    available = [paged_attention.available(), layer_matmul.available()]
print(json.dumps({"available": available, "warnings": [str(w.message) for w in caught]}))
"""


@functools.cache
def _unprivileged_prefix() -> tuple[str, ...] | None:
    """How to run a command that file modes bind: as it is for a user, `unshare --user` for root (in a
    user namespace of its own root's files are checked by their owner bits); None if neither works."""
    if os.geteuid() != 0:
        return ()
    try:
        subprocess.run(["unshare", "--user", "true"], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return ("unshare", "--user")


def unprivileged() -> tuple[str, ...]:
    prefix = _unprivileged_prefix()
    if prefix is None:
        pytest.skip("running as root without `unshare --user`: root writes into a 0o500 folder")
    return prefix


def run_probe(root: Path, tmp: Path, *, prefix: tuple[str, ...] = (), **env: str) -> dict:
    """The probe in a fresh interpreter (run under `prefix`) with the cache root `root` and TMPDIR `tmp`:
    {available: [paged attention, layer matmul], warnings: [...]}. Fails the test on any exit but 0 (a
    SIGBUS is -7)."""
    tmp.mkdir(parents=True, exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if k not in (build.CACHE_ENV, "CXX", "XDG_CACHE_HOME")}
    environ.update(JAXINFER_CACHE_DIR=str(root), TMPDIR=str(tmp), JAX_PLATFORMS="cpu", **env)
    command = [*prefix, sys.executable, "-c", PROBE]
    result = subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def library(root: Path, stem: str) -> Path:
    (path,) = (root / "kernels").glob(f"{stem}-*.so")
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A cache root holding both kernels as a clean build leaves them."""
    root = tmp_path_factory.mktemp("pristine_cache")
    assert run_probe(root, tmp_path_factory.mktemp("pristine_tmp")) == {"available": [True, True], "warnings": []}
    return root


@pytest.fixture
def cache(pristine, tmp_path) -> Path:
    root = tmp_path / "cache"
    shutil.copytree(pristine, root)
    return root


def random_bytes(path: Path, other: Path) -> None:
    path.write_bytes(os.urandom(4096))


def empty(path: Path, other: Path) -> None:
    path.write_bytes(b"")


def another_kernels_library(path: Path, other: Path) -> None:
    shutil.copyfile(other, path)


def another_kernels_library_and_digest(path: Path, other: Path) -> None:
    shutil.copyfile(other, path)
    shutil.copyfile(build.digest_path(other), build.digest_path(path))


def truncated(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # headers intact, sections cut: SIGBUS in dlopen


SLOW = pytest.mark.slow  # a rebuild each; the truncated library and the foreign digest run always
DAMAGES = [pytest.param(random_bytes, marks=SLOW), pytest.param(empty, marks=SLOW), pytest.param(another_kernels_library, marks=SLOW),
           another_kernels_library_and_digest, truncated]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__)
def test_damaged_library_is_rebuilt_and_loads(cache, tmp_path, damage):
    path = library(cache, "paged_attention")
    damage(path, library(cache, "layer_matmul"))
    assert not build.verified(path)

    assert run_probe(cache, tmp_path / "tmp") == {"available": [True, True], "warnings": []}
    assert build.verified(path)  # the rebuilt library, with the digest written beside it
    assert not any((tmp_path / "tmp").iterdir())  # built beside the cache, nothing left in the temporary folder


def test_verified_library_is_loaded_as_it_is(cache, tmp_path):
    path = library(cache, "paged_attention")
    before = path.stat()
    assert run_probe(cache, tmp_path / "tmp")["available"] == [True, True]
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rebuilt


def test_digest_names_the_library_its_size_and_sha256(cache):
    path = library(cache, "paged_attention")
    data = path.read_bytes()
    assert build.digest_path(path).read_text() == f"{path.name} {len(data)} {hashlib.sha256(data).hexdigest()}\n"


def test_damaged_library_without_compiler_is_unavailable_with_one_warning(cache, tmp_path):
    truncated(library(cache, "paged_attention"), None)
    result = run_probe(cache, tmp_path / "tmp", CXX=str(tmp_path / "no-such-compiler"))
    assert result["available"] == [False, True]  # the intact layer matmul still loads
    (warning,) = result["warnings"]
    assert "paged_attention.cc is unavailable" in warning and "no-such-compiler" in warning


def test_cache_root_under_a_file_builds_for_this_process_with_one_warning(tmp_path):
    """A root that cannot be made (below a regular file: refused even to root)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = run_probe(blocker / "cache", tmp_path / "tmp")
    assert result["available"] == [True, True]
    (warning,) = result["warnings"]
    assert "not writable" in warning and str(blocker / "cache" / "kernels") in warning
    assert not any((tmp_path / "tmp").iterdir())  # the process's own folder is removed at exit


def test_read_only_cache_with_damaged_library_builds_for_this_process(cache, tmp_path):
    prefix = unprivileged()
    path = library(cache, "paged_attention")
    truncated(path, None)
    damaged = path.read_bytes()
    (cache / "kernels").chmod(0o500)
    try:
        result = run_probe(cache, tmp_path / "tmp", prefix=prefix)
    finally:
        (cache / "kernels").chmod(0o700)
    assert result["available"] == [True, True]
    (warning,) = result["warnings"]
    assert "not writable" in warning
    assert path.read_bytes() == damaged  # the read-only cache is left as it was


def test_read_only_empty_cache_root_builds_for_this_process(tmp_path):
    prefix = unprivileged()
    root = tmp_path / "root"
    root.mkdir(mode=0o500)
    try:
        result = run_probe(root, tmp_path / "tmp", prefix=prefix)
    finally:
        root.chmod(0o700)
    assert result["available"] == [True, True]
    assert len(result["warnings"]) == 1 and "not writable" in result["warnings"][0]
