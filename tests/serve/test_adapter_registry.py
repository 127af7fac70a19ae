"""The adapter registry file (contracts/adapters.py) and the alias's weighted choice, without a server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from kubetune.contracts.adapters import (
    AdapterRegistry,
    Alias,
    check_adapter_name,
    read_registry,
    split_version,
    write_registry,
)
from kubetune.errors import UserError

GOOD = {
    "base": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "main"},
    "adapters": {
        "support": {
            "versions": {"v1": {"path": "/adapters/support/v1"}, "v2": {"path": "support/v2"}},
            "weights": {"v1": 90, "v2": 10},
        },
        "sql": {"versions": {"v1": {"path": "sql/v1"}, "v3": {"path": "sql/v3"}}},
    },
}


def test_a_registry_round_trips_and_names_its_versions_and_aliases(tmp_path):
    path = tmp_path / "registry.json"
    write_registry(path, AdapterRegistry.model_validate(GOOD))
    assert not [p for p in tmp_path.iterdir() if p.name != "registry.json"]  # the temporary file was renamed
    registry = read_registry(path)
    assert registry == AdapterRegistry.model_validate(GOOD)
    assert registry.versions(tmp_path) == [
        ("support@v1", tmp_path / "/adapters/support/v1"),
        ("support@v2", tmp_path / "support/v2"),
        ("sql@v1", tmp_path / "sql/v1"),
        ("sql@v3", tmp_path / "sql/v3"),
    ]
    # no weights: the newest version takes every request
    assert registry.aliases() == {"support": {"support@v1": 90, "support@v2": 10}, "sql": {"sql@v3": 100}}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d.pop("base"), "base: Field required"),
        (lambda d: d["adapters"]["support"]["versions"].update({"2": {"path": "x"}}), "versions: '2' is not a version"),
        (lambda d: d["adapters"]["support"]["weights"].update({"v7": 1}), "'v7' is not one of its versions"),
        (lambda d: d["adapters"]["support"]["weights"].update({"v1": -1}), "v1: a weight is a non-negative"),
        (lambda d: d["adapters"]["support"].update(weights={"v1": 0, "v2": 0}), "at least one weight"),
        (lambda d: d["adapters"].update({"a@v1": {"versions": {"v1": {"path": "x"}}}}), "has no '@'"),
        (lambda d: d["adapters"]["sql"].update(extra=1), "adapters.sql.extra: Extra inputs"),
    ],
)
def test_a_bad_registry_is_one_line_naming_the_field(tmp_path, change, named):
    data = json.loads(json.dumps(GOOD))
    change(data)
    path = tmp_path / "registry.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as e:
        read_registry(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"--adapter-registry {path}: ") and named in message, message


def test_an_unreadable_registry_is_one_line(tmp_path):
    with pytest.raises(UserError, match="cannot read it"):
        read_registry(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UserError, match="not JSON"):
        read_registry(tmp_path / "bad.json")


def test_version_names():
    assert split_version("support@v2") == ("support", "v2")
    assert split_version("support") is None and split_version("support@v0") is None
    assert check_adapter_name("support@v12") is None and check_adapter_name("plain") is None
    assert "NAME@vN" in (check_adapter_name("a@b") or "") and check_adapter_name("a@v0")


def test_an_alias_sends_each_target_exactly_its_share_spread_out():
    alias = Alias({"m@v1": 90, "m@v2": 10})
    picks = [alias.pick() for _ in range(400)]
    assert Counter(picks) == {"m@v1": 360, "m@v2": 40}
    for start in range(0, 400, 100):  # exact in every window of sum(weights) requests, never in a burst
        assert picks[start : start + 100].count("m@v2") == 10
    assert "m@v2m@v2" not in "".join(picks)
    rollback = Alias({"m@v1": 100, "m@v2": 0})
    assert {rollback.pick() for _ in range(50)} == {"m@v1"}


@pytest.mark.parametrize("weights", [{}, {"a": 0}, {"a": 1, "b": -1}])
def test_an_alias_that_routes_nowhere_is_refused(weights):
    with pytest.raises(ValueError):
        Alias(weights)


def test_the_operator_can_import_the_registry_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from kubetune.contracts.adapters import read_registry, write_registry, AdapterRegistry\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
