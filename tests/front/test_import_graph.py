"""The package's import graph has no cycle, deferred (in-function) and TYPE_CHECKING imports included, and
the host-only modules import no jax.

The graph is read from the source with `ast`, so an import inside a function counts as much as one at the
top: a cycle that only works because one side imports late is still a cycle of ownership.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = ("jaxinfer", "kernels_pallas", "kernels_cpu")
ROOT = Path(__file__).resolve().parents[2]
# Modules that must run with no jax in the process: the host scheduler, its inputs and its outputs.
HOST_ONLY = (
    "jaxinfer.validation", "jaxinfer.scheduling.request", "jaxinfer.scheduling.plan", "jaxinfer.scheduling.block_pool", "jaxinfer.scheduling.bucket_tables",
    "jaxinfer.scheduling.scheduler", "jaxinfer.scheduling.runloop", "jaxinfer.scheduling.stopping", "jaxinfer.bucketing.strategies", "jaxinfer.batch.output_file", "jaxinfer.config",
    "jaxinfer.scheduling.request_queue", "jaxinfer.scheduling.guided", "jaxinfer.batch.keys",
    "jaxinfer.batch.openai",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """In-tree modules `path` imports anywhere in its body (`from pkg import mod` counts as pkg.mod)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = [p for package in PACKAGES for p in (ROOT / package).glob("*.py")]
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imported_modules(p, modules) for p in paths}
    for name in graph:  # a package's __init__ is imported with each of its modules: not an edge of its own
        graph[name] -= {pkg for pkg in PACKAGES if name.startswith(pkg + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None; depth-first with colours."""
    colour, stack = dict.fromkeys(graph, 0), []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for child in sorted(graph[node]):
            if colour[child] == 1:
                return stack[stack.index(child) :] + [child]
            if colour[child] == 0 and (cycle := visit(child)):
                return cycle
        stack.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if colour[node] == 0 and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_import_graph_has_no_cycle_deferred_imports_included():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_deferred_cycle():
    """Control: the finder sees a cycle that closes through an import inside a function."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    source = ROOT / "jaxinfer" / "api.py"
    assert "jaxinfer.loading.loading" in imported_modules(source, {"jaxinfer.loading.loading", "jaxinfer.api"})


@pytest.mark.parametrize("module", HOST_ONLY)
def test_host_only_modules_import_no_jax(module):
    code = f"import sys, {module}; bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')); assert not bad, bad"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
