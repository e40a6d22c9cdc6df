"""The package's layers, measured from its own imports (every `import` statement, function-local ones included).

Layers, lowest first; a module may import its own layer and the ones below it, never one above:
leaves (errors, metrics, tokenizers, types, models, workloads, kernels, quantized loading) -> cache -> runners ->
costs -> structured -> decode -> speculators -> generation -> apps (pipeline, serving, demo, tools, train_eagle, cli).
Within a layer there are no import circles either. A function-local import of a package module is only allowed where
that module needs an optional dependency at import time (the Triton kernels).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_specdec"

LAYERS = [
    ("errors", "metrics", "tokenizers", "types", "models", "workloads", "extraction", "kernels", "quantized_checkpoint",
     "quantization"),
    ("cache",),
    ("runners",),
    ("costs",),
    ("structured",),
    ("decode",),
    ("speculators",),
    ("generation",),
    ("pipeline", "serving", "demo", "tools", "train_eagle", "cli", "__main__", ""),
]
# Function-local imports that stay so: the module imported needs triton, an optional dependency.
OPTIONAL_LOCAL = ("triton_kernel",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """Yields `(imported package module, is function-local, line)` for each import statement of the module."""
    is_package = path.name == "__init__.py"

    def known(dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    def visit(node, local: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module or ""
                for alias in child.names:
                    target = known(f"{source}.{alias.name}") or known(source)
                    if target and target != name:
                        yield target, local, child.lineno
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    target = known(alias.name)
                    if target and target != name:
                        yield target, local, child.lineno
            yield from visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    yield from visit(ast.parse(path.read_text()), False)


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS in {__file__}")


def _graph():
    modules = _modules()
    edges = {name: set() for name in modules}
    local = []
    for name, path in modules.items():
        for target, is_local, line in _imports(name, path, modules):
            # a package's __init__ importing its own modules, or a module its own package, is no dependency
            if target.startswith(name + ".") or name.startswith(target + ".") and modules[target].name == "__init__.py":
                continue
            edges[name].add(target)
            if is_local:
                local.append((name, target, line))
    return edges, local


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            connect(v)
    return found


def test_no_import_circles():
    assert _cycles(_graph()[0]) == []


def test_imports_run_downward_only():
    upward = sorted((name, target) for name, targets in _graph()[0].items() for target in targets
                    if _layer(target) > _layer(name))
    assert upward == []


def test_function_local_imports_only_for_optional_dependencies():
    local = [(name, target, line) for name, target, line in _graph()[1] if not target.endswith(OPTIONAL_LOCAL)]
    assert local == []


def test_no_module_over_500_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}


def test_the_checker_sees_a_circle_and_an_upward_import():
    edges = {"hf_specdec.cache.paged": {"hf_specdec.decode.step"}, "hf_specdec.decode.step": {"hf_specdec.cache.paged"}}
    assert _cycles(edges) == [["hf_specdec.cache.paged", "hf_specdec.decode.step"]]
    assert _layer("hf_specdec.cache.paged") < _layer("hf_specdec.decode.step")


@pytest.mark.parametrize("code", [
    "import hf_specdec.kernels; import hf_specdec.kernels.rejection_sample",
    "import importlib.util, pathlib; spec = importlib.util.find_spec('kernels'); here = pathlib.Path.cwd().resolve(); "
    "places = [] if spec is None else list(spec.submodule_search_locations or [spec.origin]); "
    "assert not any(pathlib.Path(p).resolve().is_relative_to(here) for p in places), places",
])
def test_imports_from_the_repository_root(code):
    """From a checkout's root (cwd first on sys.path), `hf_specdec.kernels` imports, and a top-level `kernels` (PyPI's
    package, which transformers probes for) never resolves to this repository."""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_kernels_not_a_top_level_folder():
    assert importlib.util.find_spec("hf_specdec.kernels") is not None
    assert not (ROOT / "kernels").exists()
