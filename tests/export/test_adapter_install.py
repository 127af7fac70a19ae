"""The adapter-export Job's command: a run's adapter copied into a shared server's volume and
registered in its registry (`kubetune.contracts.adapters`), then unregistered, as a process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kubetune.contracts.adapters import AdapterRegistry, BaseModelRef, read_registry
from kubetune.errors import UserError
from kubetune.export.adapter_install import install, register, uninstall, unregister
from tests.kit.paths import REPO

BASE = BaseModelRef(name="org/base", revision="main")


def _run(tmp_path: Path, name: str = "run") -> Path:
    adapter = tmp_path / name / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base", "r": 4}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    return tmp_path / name


def test_versions_install_side_by_side_and_the_newest_takes_the_alias(tmp_path):
    root = tmp_path / "adapters"
    install(_run(tmp_path, "a"), "cardio", "v1", BASE, root)
    install(_run(tmp_path, "b"), "cardio", "v2", BASE, root)
    registry = read_registry(root / "registry.json")
    versions = {"v1": {"path": f"{root}/cardio/v1"}, "v2": {"path": f"{root}/cardio/v2"}}
    assert registry.model_dump(exclude_none=True) == {
        "base": {"name": "org/base", "revision": "main"},
        "adapters": {"cardio": {"versions": versions, "weights": {}}},
    }
    assert (root / "cardio" / "v2" / "adapter_model.safetensors").read_bytes() == b"weights"
    assert registry.versions(root) == [("cardio@v1", root / "cardio" / "v1"), ("cardio@v2", root / "cardio" / "v2")]
    assert registry.aliases() == {"cardio": {"cardio@v2": 100}}


def test_another_base_is_refused_and_the_registry_kept(tmp_path):
    root = tmp_path / "adapters"
    install(_run(tmp_path), "cardio", "v1", BASE, root)
    with pytest.raises(UserError, match="org/base@main, not org/other@main"):
        register(root / "registry.json", BaseModelRef(name="org/other", revision="main"), "x", "v1", "/adapters/x/v1")
    assert list(AdapterRegistry.model_validate_json((root / "registry.json").read_text()).adapters) == ["cardio"]


def test_unregister_keeps_the_files_unless_asked(tmp_path):
    root = tmp_path / "adapters"
    install(_run(tmp_path, "a"), "cardio", "v1", BASE, root)
    install(_run(tmp_path, "b"), "radio", "v1", BASE, root)
    uninstall("cardio", "v1", root, delete_files=False)
    assert (root / "cardio" / "v1").is_dir()
    uninstall("radio", "v1", root, delete_files=True)
    assert not (root / "radio" / "v1").exists()
    assert read_registry(root / "registry.json").adapters == {}


def test_unregistering_a_weighted_version_leaves_a_valid_route(tmp_path):
    root = tmp_path / "adapters"
    for version in ("v1", "v2"):
        install(_run(tmp_path, version), "cardio", version, BASE, root)
    registry = read_registry(root / "registry.json")
    entry = registry.adapters["cardio"].model_copy(update={"weights": {"v1": 0, "v2": 100}})
    (root / "registry.json").write_text(registry.model_copy(update={"adapters": {"cardio": entry}}).model_dump_json())
    unregister(root / "registry.json", "cardio", "v2")  # v1's weight 0 alone would route nowhere
    assert read_registry(root / "registry.json").aliases() == {"cardio": {"cardio@v1": 100}}


@pytest.mark.process
def test_the_jobs_command_as_a_process(tmp_path):
    root = tmp_path / "adapters"
    cmd = [sys.executable, "-m", "kubetune.export.adapter_install"]
    args = ["--name", "cardio", "--version", "v1", "--base", "org/base", "--root", str(root)]
    ok = subprocess.run([*cmd, str(_run(tmp_path)), *args], cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([*cmd, str(tmp_path / "nothing"), *args], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        (
            f"kubetune: {tmp_path / 'nothing' / 'adapter'} holds no PEFT adapter (adapter_config.json): "
            f"is {tmp_path / 'nothing'} a finished LoRA run?"
        )
    ]
