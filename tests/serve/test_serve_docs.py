"""The serving page's example (docs/serving.md) runs as written (against a served tiny run), and its metric
contract lists exactly what the server exposes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.kit.paths import REPO

pytestmark = pytest.mark.process

SERVING = (REPO / "docs" / "serving.md").read_text()


def test_the_readme_client_example_runs(tiny_server):
    block = re.search(r"<!-- serve-example -->\s*```python\n(.*?)```", SERVING, re.S)
    assert block, "the serving example is marked <!-- serve-example -->"
    code = (
        block.group(1).replace("http://127.0.0.1:8000", tiny_server.url).replace('"smollm2-135m-lora-cpu"', '"run-a"')
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "run-a" in r.stdout and "completion_tokens" in r.stdout


def test_the_metric_contract_is_what_the_server_exposes(tiny_server):
    section = SERVING.split("## Serving metrics", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `((?:vllm|kubetune):[a-z0-9_]+)", section, re.M))
    exposed = {name for name, _ in tiny_server.metrics()}
    for name in documented:
        kind_suffixes = ("", "_bucket", "_count")
        assert any(name + s in exposed for s in kind_suffixes), f"{name} is documented but not exposed"
    for name in exposed:
        base = re.sub(r"_(bucket|count|sum|created)$", "", name)
        assert base in documented or base.removesuffix("_total") + "_total" in documented, f"{name} is not documented"
