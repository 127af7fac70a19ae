"""The operator renders and runs without torch: its image need not carry the training engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.process

CODE = """
import sys
sys.modules["torch"] = None  # any import of torch now fails
from kubetune.operator import handlers, main, crd, plan, actions
from kubetune.k8s.export_job import export_job
from kubetune.k8s.names import Names
from kubetune.k8s.render import render
from kubetune.k8s.serve.render import render_serve
spec = plan.FineTuneSpec.from_dict({"recipe": {"train": {"max_steps": 5}}, "serve": {"enabled": True}})
recipe = plan.resolved(plan.load_recipe_for("ft", "team", spec.recipe, spec))
owner = {"metadata": {"name": "ft", "namespace": "team", "uid": "u"}}
objects = plan.owned(render(recipe).objects, owner, False)
objects += [export_job(recipe, Names.for_job("ft", "team"), "ft-export")]
objects += render_serve(recipe, spec.serve.settings).objects
crd.crd_yaml()
bad = sorted(m for m, v in sys.modules.items() if v and m.startswith(("torch", "kubetune.training", "transformers")))
print(len(objects), ",".join(bad))
"""


def test_operator_renders_without_torch():
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    count, bad = result.stdout.split(" ", 1)
    assert int(count) > 8 and bad.strip() == ""
