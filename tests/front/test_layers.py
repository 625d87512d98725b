"""The layers, by path: the package's import graph has no cycle (deferred and TYPE_CHECKING imports included), its
folders form a graph of at most MAX_LEVELS levels, each folder imports only the layers below it, nothing under
`jaxinfer/scheduling/` imports jax, and no module or function outgrows a sitting.

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
MAX_LEVELS = 10  # longest import chain when each folder (and each top-level module) counts as one node
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60  # outside the kernels (kernels_pallas/, kernels_cpu/), whose bodies are one unit each
# Which layers each folder may import (besides its own modules and the kernel folders): ARCHITECTURE's rules.
ALLOWED = {
    "jaxinfer.validation": set(),
    "jaxinfer.config": {"jaxinfer.validation"},
    "jaxinfer.scheduling": {"jaxinfer.validation", "jaxinfer.config"},
    "jaxinfer.model": {"jaxinfer.validation", "jaxinfer.config"},
    "jaxinfer.bucketing": {"jaxinfer.validation", "jaxinfer.config", "jaxinfer.scheduling"},
}
RUNTIME = ("jaxinfer.scheduling", "jaxinfer.model", "jaxinfer.engine", "jaxinfer.loading", "jaxinfer.api", "jaxinfer.outputs",
           "jaxinfer.batch")  # what a generation job imports; none of it may import the offline bucket research


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


def source_files() -> list[Path]:
    return [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]


def import_graph() -> dict[str, set[str]]:
    """Module -> the in-tree modules it imports (a package's own __init__ is not an edge: it comes with every module)."""
    paths = source_files()
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imported_modules(p, modules) for p in paths}
    packages = {name for name in modules if (ROOT / Path(*name.split("."))).is_dir()}
    for name in graph:
        graph[name] -= {pkg for pkg in packages if name.startswith(pkg + ".") or name == pkg}
    return graph


def layer_of(module: str) -> str:
    """A module's node in the layer graph: its folder under jaxinfer/ (or the kernel folder), else itself."""
    parts = module.split(".")
    if parts[0] != "jaxinfer":
        return parts[0]
    return ".".join(parts[:2])


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    layers: dict[str, set[str]] = {}
    for module, imports in graph.items():
        if module == "jaxinfer":  # the lazy public API re-exports every layer by name, importing none of them
            continue
        edges = layers.setdefault(layer_of(module), set())
        edges.update(layer_of(m) for m in imports if layer_of(m) != layer_of(module) and m != "jaxinfer")
    return layers


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of nodes (first == last), or None; depth-first with colours."""
    colour, stack = dict.fromkeys(graph, 0), []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if colour.get(child, 0) == 1:
                return stack[stack.index(child) :] + [child]
            if colour.get(child, 0) == 0 and (cycle := visit(child)):
                return cycle
        stack.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if colour[node] == 0 and (cycle := visit(node)):
            return cycle
    return None


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain of an acyclic graph, importer first."""
    best: dict[str, list[str]] = {}

    def chain(node: str) -> list[str]:
        if node not in best:
            below = [chain(child) for child in graph.get(node, ())]
            best[node] = [node] + max(below, key=len, default=[])
        return best[node]

    return max((chain(node) for node in graph), key=len)


def test_the_package_import_graph_has_no_cycle_deferred_imports_included():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_layers_form_no_cycle_and_at_most_max_levels():
    layers = layer_graph(import_graph())
    cycle = find_cycle(layers)
    assert cycle is None, " -> ".join(cycle)
    chain = longest_chain(layers)
    assert len(chain) <= MAX_LEVELS, " -> ".join(chain)


def test_each_lower_layer_imports_only_the_layers_below_it():
    layers = layer_graph(import_graph())
    for layer, allowed in ALLOWED.items():
        extra = layers.get(layer, set()) - allowed - {"kernels_cpu", "kernels_pallas"}
        assert not extra, f"{layer} imports {sorted(extra)}"
    assert not layers["kernels_cpu"] and not layers["kernels_pallas"], "the kernels import nothing of jaxinfer"


def test_the_runtime_never_imports_the_offline_bucket_research():
    graph = import_graph()
    offenders = {m: sorted(i for i in imports if layer_of(i) == "jaxinfer.bucketing") for m, imports in graph.items()
                 if layer_of(m) in RUNTIME}
    assert not any(offenders.values()), {m: i for m, i in offenders.items() if i}


def test_the_layer_checks_find_a_deferred_cycle_and_a_long_chain():
    """Controls: the finder sees a cycle that closes through an import inside a function, and the chain
    counter counts nodes along the longest path."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert longest_chain({"a": {"b", "d"}, "b": {"c"}, "c": set(), "d": set()}) == ["a", "b", "c"]
    source = ROOT / "jaxinfer" / "api.py"
    assert "jaxinfer.engine.tuning" in imported_modules(source, {"jaxinfer.engine.tuning", "jaxinfer.api"})
    assert layer_of("jaxinfer.scheduling.plan") == "jaxinfer.scheduling" and layer_of("jaxinfer.cli") == "jaxinfer.cli"


HOST_ONLY = sorted(module_name(p) for p in (ROOT / "jaxinfer" / "scheduling").rglob("*.py")) + [
    "jaxinfer.config", "jaxinfer.validation", "jaxinfer.options", "jaxinfer.bucketing.strategies", "jaxinfer.bucketing.traces",
    "jaxinfer.bucketing.cli"]


def test_every_host_only_module_imports_no_jax():
    """Every module under scheduling/ (by path: a new one is checked without being listed), the config
    leaves and the offline bucket tools run with no jax in the process; one interpreter imports each in turn
    and reports the first that pulls jax in."""
    code = ("import importlib, sys\n"
            f"for name in {HOST_ONLY!r}:\n"
            "    importlib.import_module(name)\n"
            "    bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
            "    assert not bad, (name, bad[:5])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "jaxinfer.scheduling.scheduler" in HOST_ONLY and "jaxinfer.scheduling.block_pool" in HOST_ONLY


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


@pytest.mark.parametrize("path", sorted((ROOT / "jaxinfer").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_outgrows_a_sitting(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines"
    long = [(f.name, f.end_lineno - f.lineno + 1) for f in _functions(ast.parse(path.read_text()))
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_test_files_have_unique_names_across_folders():
    """The test folders have no __init__.py (pytest's rootdir import mode), so two files of one name in two
    folders stop the whole collection: the mirror must name each file once."""
    names: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
