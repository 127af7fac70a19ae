"""A skip the suite does not expect fails the run; an expected one, or an xfail, does not."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CONFTEST = """
from tests.kit.skips import pytest_configure  # the hook under test
"""

TESTS = """
import pytest

def test_runs():
    pass

@pytest.mark.xfail(reason="known")
def test_known_bug():
    assert False

def test_skips():
    pytest.skip(REASON)
"""


def run(pytester: pytest.Pytester, reason: str, *env: tuple[str, str]) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_gate=TESTS.replace("REASON", repr(reason)))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KUBETUNE_ALLOW_SKIPS", raising=False)
        for name, value in env:
            mp.setenv(name, value)
        return pytester.runpytest("-q")


def test_an_unexpected_skip_fails_the_run_and_is_named(pytester: pytest.Pytester):
    result = run(pytester, "kubectl is not installed")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*unexpected skips*", "test_gate.py::test_skips: kubectl is not installed"])


def test_an_expected_skip_and_an_xfail_pass(pytester: pytest.Pytester):
    result = run(pytester, "vLLM is not installed (set KUBETUNE_VLLM_PYTHON)")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.assert_outcomes(passed=1, skipped=1, xfailed=1)


def test_an_unexpected_skip_at_collection_fails_too(pytester: pytest.Pytester):
    pytester.makepyfile(test_needs="import pytest\npytest.importorskip('no_such_module_here')\n")
    result = run(pytester, "vLLM is not installed")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*test_needs.py*no_such_module_here*"])


def test_the_allow_variable_lets_a_run_with_skips_pass(pytester: pytest.Pytester):
    result = run(pytester, "kubectl is not installed", ("KUBETUNE_ALLOW_SKIPS", "1"))
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*unexpected skips (allowed by KUBETUNE_ALLOW_SKIPS)*"])
