"""Fixtures for the cluster tests (the fakes themselves live in fakes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("grpc")

from .fakes import FakeKubelet


@pytest.fixture
def plugin_dir(tmp_path) -> Path:
    # unix socket paths are limited to ~107 bytes; tmp_path is short enough on Linux runners
    d = tmp_path / "dp"
    d.mkdir()
    return d


@pytest.fixture
def kubelet(plugin_dir):
    k = FakeKubelet(plugin_dir).start()
    yield k
    k.stop()
