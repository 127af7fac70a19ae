"""The layers of docs/ARCHITECTURE.md hold: imports point one way, and the engine's
functions stay short enough to read at once.

The import rules are import-linter contracts (`[tool.importlinter]` in pyproject.toml): each one
follows imports through other modules, deferred imports inside functions included. What a
static graph cannot see (a third-party package that imports torch itself, an import made while
rendering) the runtime checks see: the torch-refusing interpreters of
tests/k8s/test_images_and_layers.py, tests/operator/test_no_torch.py, tests/cluster and tests/serve."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
SRC = REPO / "src" / "kubetune"
PYPROJECT = REPO / "pyproject.toml"
CONTRACTS = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
MAX_ENGINE_FUNCTION_LINES = 60


def _contract(contract_id: str) -> dict:
    (contract,) = [c for c in CONTRACTS if c["id"] == contract_id]
    return contract


def _lint_imports(src: Path, *contract_ids: str) -> subprocess.CompletedProcess:
    """`lint-imports` over the kubetune package found in `src` (first on the path, ahead of the install)."""
    binary = Path(sys.executable).with_name("lint-imports")  # import-linter, a dev extra
    assert binary.is_file(), "lint-imports is missing: pip install -e '.[dev]'"
    selected = [arg for contract_id in contract_ids for arg in ("--contract", contract_id)]
    return subprocess.run(
        [str(binary), "--no-cache", "--no-logo", *selected, str(PYPROJECT)],
        env={**os.environ, "PYTHONPATH": str(src)},
        cwd=src,  # lint-imports puts its working directory on the path too
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.process  # starts lint-imports
def test_the_import_contracts_hold():
    result = _lint_imports(SRC.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in result.stdout


def _layer_modules(contract: dict) -> set[str]:
    names = [m for layer in contract.get("layers", []) for m in layer.split("|")] + contract.get("source_modules", [])
    return {name.strip().strip("()") for name in names}


def test_every_package_has_its_place_in_a_contract():
    # a new module or package at the top of kubetune fails here until a contract says where it sits
    placed = {".".join(name.split(".")[:2]) for c in CONTRACTS for name in _layer_modules(c)}
    top = {f"kubetune.{p.stem}" for p in SRC.iterdir() if p.suffix == ".py" and p.stem != "__init__"}
    top |= {f"kubetune.{p.name}" for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(top - placed) == []


def test_architecture_names_every_contract_and_top_level_module():
    text = ARCHITECTURE.read_text()
    contracts = text.partition("### Which contract holds which arrow")[2].partition("###")[0]
    assert sorted(re.findall(r"^\| `([a-z0-9-]+)` \|", contracts, re.M)) == sorted(c["id"] for c in CONTRACTS)
    names = [f"{p.name}/" if p.is_dir() else p.name for p in SRC.iterdir() if p.suffix == ".py" or p.is_dir()]
    shown = [n for n in names if n not in ("__init__.py", "__main__.py", "__pycache__/")]
    assert [n for n in sorted(shown) if f"`{n}`" not in text] == []


# (file under src/kubetune, line appended to it, the contract it breaks, the import lint-imports reports)
BREAKS = [
    # k8s reading monitor's dashboards (monitor renders over k8s, not under it)
    ("k8s/scrape.py", "from kubetune.monitor import objects", "cluster-layers", "scrape -> kubetune.monitor.objects"),
    # a contract reading a side that reads it
    ("contracts/monitors.py", "from kubetune.k8s import names", "cluster-layers", "monitors -> kubetune.k8s.names"),
    # torch imported inside a function of the renderer
    ("k8s/render.py", "def _later():\n    import torch", "torch-free", "kubetune.k8s.render -> torch"),
    # torch reached through another module: the serving contract k8s imports, importing the grammars
    (
        "contracts/serving.py",
        "import kubetune.serve.native.structured",
        "torch-free",
        "serving -> kubetune.serve.native.structured",
    ),
    ("contracts/progress_line.py", "import kubetune.errors", "stdlib-only", "progress_line -> kubetune.errors"),
    ("serve/native/models.py", "from kubetune.training import run", "engine-layers", "models -> kubetune.training.run"),
    # the HTTP side reaching past the seam, to what composes the engine
    ("serve/http/state.py", "import kubetune.serve.server", "http-through-the-seam", "state -> kubetune.serve.server"),
    ("export/weights.py", "from kubetune.k8s import names", "engine-not-cluster", "weights -> kubetune.k8s.names"),
]


def _squeezed(text: str) -> str:
    return "".join(text.split())  # lint-imports wraps long names over lines


def _broken_sections(report: str) -> dict[str, str]:
    """Each broken contract's part of a lint-imports report, by contract id."""
    text = _squeezed(report.partition("Broken contracts")[2])
    starts = sorted((text.find(_squeezed(c["name"])), c["id"]) for c in CONTRACTS if _squeezed(c["name"]) in text)
    ends = [start for start, _ in starts[1:]] + [len(text)]
    return {contract_id: text[start:end] for (start, contract_id), end in zip(starts, ends)}


@pytest.mark.process  # starts lint-imports
def test_each_forbidden_import_breaks_its_contract(tmp_path):
    tree = tmp_path / "kubetune"
    shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__"))
    for path, line, _, _ in BREAKS:
        with (tree / path).open("a") as f:
            f.write(f"\n\n{line}\n")
    result = _lint_imports(tmp_path, *sorted({contract_id for _, _, contract_id, _ in BREAKS}))
    assert result.returncode == 1, result.stdout + result.stderr
    sections = _broken_sections(result.stdout)
    for path, _, contract_id, reported in BREAKS:
        assert _squeezed(reported) in sections.get(contract_id, ""), f"{path}: {contract_id}\n{result.stdout}"


def _files(name: str) -> list[Path]:
    path = SRC / name
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


def _long_functions(paths: list[Path], root: Path = SRC) -> list[str]:
    long = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                where = path.relative_to(root).as_posix()
                if lines > MAX_ENGINE_FUNCTION_LINES:
                    long.append(f"{where}:{node.lineno} {node.name}: {lines} lines")
    return long


def test_engine_functions_fit_on_a_screen():
    long = _long_functions(_files("training"))
    assert not long, "\n".join(long)


def test_command_functions_fit_on_a_screen():
    # a command's options count: a signature too long to read is split as a body is
    cli_files = sorted(SRC.rglob("cli.py"))
    assert {p.relative_to(SRC).as_posix() for p in cli_files} >= {"cli.py", "k8s/cli.py", "monitor/cli.py"}
    long = _long_functions(cli_files)
    assert not long, "\n".join(long)


def test_the_function_cap_sees_a_long_function(tmp_path):
    cli = tmp_path / "cluster" / "cli.py"
    cli.parent.mkdir()
    body = "    x = 1\n" * MAX_ENGINE_FUNCTION_LINES
    cli.write_text(f"def long():\n{body}\n\ndef short():\n    x = 1\n")
    assert _long_functions([cli], root=tmp_path) == [f"cluster/cli.py:1 long: {MAX_ENGINE_FUNCTION_LINES + 1} lines"]
