"""Fixtures over a real Prometheus and promtool (tests/monitor/promtest.py), reusable by the
end-to-end monitoring test:

- `promtool`: the promtool binary (fails without it unless KUBETUNE_SKIP_PROMETHEUS=1);
- `replay_exporter`: loopback exporter serving DCGM, Gaudi, node-exporter, cAdvisor samples and
  kubetune's own series (tests/monitor/samples.py), paths /dcgm /gaudi /node /cadvisor
  /training /serving /deviceplugin /extender;
- `start_prometheus(jobs, rule_files=())`: a started Prometheus scraping `jobs`
  (`promtest.scrape_job(...)`), stopped at the end of the test.
"""

from __future__ import annotations

import contextlib

import pytest

from . import samples
from .promtest import PROMTOOL, ReplayExporter, require, running_prometheus


@pytest.fixture(scope="session")
def promtool() -> str:
    return require(PROMTOOL)


@pytest.fixture(scope="module")
def replay_exporter():
    exporter = ReplayExporter(samples.routes())
    yield exporter
    exporter.close()


@pytest.fixture
def start_prometheus(tmp_path):
    with contextlib.ExitStack() as stack:
        started = []

        def start(jobs, rule_files=()):
            directory = tmp_path / f"prometheus-{len(started)}"
            started.append(stack.enter_context(running_prometheus(directory, list(jobs), tuple(rule_files))))
            return started[-1]

        yield start
