"""The fast tier (`-m "not slow and not process"`) leaves out every test that starts a process:
those marked in their module, the `multiproc` ones and those on a fixture that starts a server."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CONFTEST = """
import pytest
from tests.conftest import pytest_collection_modifyitems  # the hook under test

@pytest.fixture
def tiny_server():
    return "a server"
"""

INI = """
[pytest]
asyncio_default_fixture_loop_scope = function
markers =
    process: starts a process
    multiproc: starts several
"""

TESTS = """
import pytest

def test_pure():
    pass

def test_on_the_server(tiny_server):
    pass

@pytest.mark.multiproc
def test_several_processes():
    pass
"""


def test_the_fast_tier_keeps_only_the_tests_that_start_no_process(pytester: pytest.Pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    pytester.makepyfile(test_tier=TESTS)
    result = pytester.runpytest("--strict-markers", "-m", "not process", "--collect-only", "-q")
    kept = [line.split("::")[1] for line in result.outlines if "::" in line]
    assert kept == ["test_pure"]
    everything = pytester.runpytest("--strict-markers", "--collect-only", "-q")
    assert len([line for line in everything.outlines if "::" in line]) == 3
