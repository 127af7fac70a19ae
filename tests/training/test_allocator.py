"""`kubetune train` runs on jemalloc where it is installed: the CLI re-executes itself once
with it preloaded (its workers inherit it); KUBETUNE_ALLOCATOR=system keeps glibc; a program
that calls the CLI in-process is never replaced."""

import os
import subprocess
import sys

import pytest

from kubetune.training import allocator

pytestmark = pytest.mark.process

PROBE = "from kubetune.training.allocator import *; reexec_with_jemalloc(); print(jemalloc_loaded(), describe())\n"


def test_only_the_kubetune_command_is_reexecuted():
    assert allocator.started_as_kubetune(["/v/bin/python", "/v/bin/kubetune", "train"])
    assert allocator.started_as_kubetune(["python", "-m", "kubetune", "train"])
    assert not allocator.started_as_kubetune(["python", "-m", "pytest", "tests"])
    assert not allocator.started_as_kubetune(["python", "bench/train_vs_hf.py"])
    assert not allocator.started_as_kubetune(["python"])
    allocator.reexec_with_jemalloc()  # in this pytest process: returns, nothing replaced


def test_preload_puts_the_library_first_once():
    env = allocator.preload_env({"LD_PRELOAD": "/x/libfoo.so:/lib/libjemalloc.so.2"}, "/lib/libjemalloc.so.2")
    assert env["LD_PRELOAD"] == "/lib/libjemalloc.so.2:/x/libfoo.so"


@pytest.mark.skipif(allocator.find_jemalloc() is None, reason="libjemalloc2 is not installed here")
@pytest.mark.parametrize(("setting", "expected"), [("auto", "True jemalloc"), ("system", "False glibc malloc")])
def test_the_command_reexecutes_on_jemalloc_unless_told_not_to(tmp_path, setting, expected):
    script = tmp_path / "kubetune"  # the process's command line is then `python .../kubetune`
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, env={**env, allocator.ENV: setting}
    ).stdout
    assert out.startswith(expected)
