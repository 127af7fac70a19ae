"""Each serving default is declared once, in contracts/serving.py, and the server, `kubetune serve`'s
flags and the rendered pod all read it: with the constants changed before anything imports them,
every one of them follows (a restated literal would keep the old value and fail here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process  # a fresh interpreter, so that the changed constants come first

PATCHED = {
    "DRAIN_TIMEOUT_S": 47,
    "DEFAULT_MAX_BODY_BYTES": 3 << 20,
    "DEFAULT_PORT": 8123,
    "LOCAL_HOST": "127.0.0.2",
    "POD_HOST": "::",
}

READ_EVERYWHERE = """
import json, sys
import kubetune.contracts.serving as contract
for name, value in json.loads(sys.argv[1]).items():
    setattr(contract, name, value)

import typer.main
from kubetune.cli import app
from kubetune.k8s.serve import ServeSettings
from kubetune.k8s.serve.deployment import EXIT_MARGIN_S, PRESTOP_SLEEP_S
from kubetune.k8s.serve.network import nginx_size
from kubetune.k8s.serve.render import render_serve
from kubetune.recipe.loader import load_recipe
from kubetune.serve.server import ServeOptions

flags = {p.name: p.default for p in typer.main.get_command(app).commands["serve"].params}
recipe = load_recipe("smollm2-135m-lora-cpu", ["k8s.profile=cpu"]).recipe
objects = render_serve(recipe, ServeSettings(ingress_host="llm.example.com")).objects
pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
ingress = [o for o in objects if o["kind"] == "Ingress"]
opts = ServeOptions("run")
print(json.dumps({
    "drain": {
        "server": opts.drain_seconds,
        "flag": flags["drain_seconds"],
        "pod": pod["terminationGracePeriodSeconds"] - PRESTOP_SLEEP_S - EXIT_MARGIN_S,
    },
    "body": {
        "server": opts.api.max_body_bytes,
        "flag": flags["max_body_bytes"],
        "ingress": [i["metadata"]["annotations"] for i in ingress],
        "nginx": nginx_size(contract.DEFAULT_MAX_BODY_BYTES),
    },
    "port": {
        "server": opts.port,
        "flag": flags["port"],
        "pod": pod["containers"][0]["ports"][0]["containerPort"],
    },
    "host": {
        "server": opts.host,
        "flag": flags["host"],
        "pod": pod["containers"][0]["command"][pod["containers"][0]["command"].index("--host") + 1],
    },
}))
"""


def test_the_drain_body_limit_port_and_hosts_come_from_the_contract_alone():
    out = subprocess.run(
        [sys.executable, "-c", READ_EVERYWHERE, json.dumps(PATCHED)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["drain"] == {"server": 47, "flag": 47, "pod": 47}
    assert seen["port"] == {"server": 8123, "flag": 8123, "pod": 8123}
    assert seen["host"] == {"server": "127.0.0.2", "flag": "127.0.0.2", "pod": "::"}
    body = seen["body"]
    assert body["server"] == body["flag"] == 3 << 20
    assert body["ingress"] and all(body["nginx"] in a.values() for a in body["ingress"])
