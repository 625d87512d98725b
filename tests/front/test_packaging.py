"""A wheel install, not the editable one `make` makes, ships what the CPU kernels need to build.

The wheel is built from a copy of the package sources, so a stale build/ in the checkout cannot supply a file
the package data leaves out. It is installed with `pip --target` into an empty folder, and imported by a
subprocess whose working directory and PYTHONPATH exclude the checkout. The kernel cache
(build.CACHE_ENV) points at an empty folder, so a library built earlier from the checkout cannot stand in.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_cpu import build

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "jaxinfer_lm_eval.pth", "README.md", "jaxinfer", "kernels_pallas", "kernels_cpu")

# Run in the installed copy: where each package came from, whether each kernel built and registered, what
# 'auto' resolves to for an f32 model, and any warning (the fallback warns instead of raising).
PROBE = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import jaxinfer, kernels_cpu
    from jaxinfer.engine import backends
    from kernels_cpu import layer_matmul, paged_attention
    result = {
        "files": [jaxinfer.__file__, kernels_cpu.__file__],
        "available": [paged_attention.available(), layer_matmul.available()],
        "auto_impl": backends.resolve_impl("auto", dtype="float32"),
    }
result["warnings"] = [str(w.message) for w in caught]
print(json.dumps(result))
"""


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def _install_wheel(tmp_path: Path) -> Path:
    """Build the wheel from a copy of the sources and install it alone into a fresh folder; returns it."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=lambda folder, names: [] if folder != str(ROOT) else set(names) - set(SOURCES))
    for cache in source.rglob("__pycache__"):
        shutil.rmtree(cache)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", tmp_path / "wheels", source])
    (wheel,) = (tmp_path / "wheels").glob("jaxinfer-*.whl")
    _run([*pip, "install", "--quiet", "--no-deps", "--target", tmp_path / "site", wheel])
    return tmp_path / "site"


@pytest.mark.slow
def test_cpu_kernels_build_and_load_from_an_installed_wheel(tmp_path):
    site, cache, elsewhere = _install_wheel(tmp_path), tmp_path / "kernel-cache", tmp_path / "cwd"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", build.CACHE_ENV)}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1", JAX_PLATFORMS="cpu", **{build.CACHE_ENV: str(cache)})
    result = json.loads(_run([sys.executable, "-c", PROBE], cwd=elsewhere, env=env).stdout.splitlines()[-1])
    assert all(Path(f).is_relative_to(site) for f in result["files"]), result["files"]  # not the checkout
    assert result["available"] == [True, True], result["warnings"]
    assert result["auto_impl"] == "cpu"
    assert sorted(p.name.split("-")[0] for p in cache.glob("*.so")) == ["layer_matmul", "paged_attention"]  # built here, now
    assert (site / "jaxinfer_lm_eval.pth").read_text().startswith("import jaxinfer.lm_eval_hook")  # lm_eval --model jaxinfer
