"""The layers of docs/ARCHITECTURE.md hold: imports point one way, and the engine's
functions stay short enough to read at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kubetune"

# module (file or package under src/kubetune) -> kubetune modules it must never import
FORBIDDEN = {
    "recipe": (
        "kubetune.data",
        "kubetune.models",
        "kubetune.training",
        "kubetune.export",
        "kubetune.k8s",
        "kubetune.cluster",
    ),
    "data": ("kubetune.models", "kubetune.training", "kubetune.export", "kubetune.k8s", "kubetune.cluster"),
    "models": ("kubetune.training", "kubetune.export", "kubetune.k8s", "kubetune.cluster"),
    "export.py": ("kubetune.training", "kubetune.k8s", "kubetune.cluster"),
    "gguf_export.py": ("kubetune.training", "kubetune.k8s", "kubetune.cluster"),
    "rundir.py": ("kubetune.data", "kubetune.models", "kubetune.training", "kubetune.export"),
    "training": ("kubetune.k8s", "kubetune.cluster", "kubetune.evaluate", "kubetune.generate", "kubetune.cli"),
    "kube.py": ("kubetune.recipe", "kubetune.training", "kubetune.models", "kubetune.data"),
    # serving reads runs (models, export, rundir), never the training engine or the cluster code
    "serve": ("kubetune.training", "kubetune.k8s", "kubetune.cluster", "kubetune.evaluate"),
    # shared by `kubetune serve` and the torch-free `k8s render-serve`
    "serve/contract.py": ("kubetune.models", "kubetune.data", "kubetune.export", "torch"),
    # printed by the engine, parsed by the torch-free k8s layer: stdlib only
    "progress_line.py": ("kubetune", "torch"),
    # monitoring renders and checks without torch; of serving it reads only the contract (ALLOWED)
    "monitor": (
        "torch",
        "kubetune.training",
        "kubetune.models",
        "kubetune.data",
        "kubetune.export",
        "kubetune.serve",
        "kubetune.cluster",
    ),
    # the metric names, exported by training and serving, read by everything else: stdlib only
    "monitor/contract.py": ("kubetune", "torch"),
    # shared with kubetune.cluster, which must not import the recipe
    "monitor/monitors.py": ("kubetune.recipe", "kubetune.k8s", "torch"),
    # the FineTune operator: recipe, kube, k8s (renderers, client) and the contracts; never the engine
    "operator": (
        "torch",
        "kubetune.training",
        "kubetune.models",
        "kubetune.data",
        "kubetune.export",
        "kubetune.serve",
        "kubetune.monitor",
        "kubetune.cluster",
        "kubetune.evaluate",
        "kubetune.generate",
    ),
}
# exceptions to FORBIDDEN: the pure contract modules a layer may share
ALLOWED = {
    "monitor": ("kubetune.serve.contract",),
    "operator": ("kubetune.serve.contract", "kubetune.monitor.contract"),
}
MAX_ENGINE_FUNCTION_LINES = 60


def _files(name: str) -> list[Path]:
    path = SRC / name
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` names, at any depth (deferred imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_point_one_way(layer):
    bad = []
    for path in _files(layer):
        for module in _imports(path):
            if module.startswith(FORBIDDEN[layer]) and not module.startswith(ALLOWED.get(layer, ())):
                bad.append(f"{path.relative_to(SRC)} imports {module}")
    assert not bad, "\n".join(bad)


def test_engine_functions_fit_on_a_screen():
    long = []
    for path in _files("training"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_ENGINE_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)


def test_the_checker_sees_deferred_imports(tmp_path):
    # the import test must fail on an import inside a function, not only at the top
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from kubetune.training.run import train_from_recipe\n")
    assert "kubetune.training.run" in _imports(f)
