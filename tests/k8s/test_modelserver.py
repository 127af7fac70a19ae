"""A ModelServer's objects (`kubetune.k8s.modelserver`): the serving builders' Deployment with
the base model, runtime adapters and the adapter volume, and the gateway's InferencePool and
InferenceObjectives, each validated against its schema (core kinds strictly, the Inference
Extension's against its vendored CRDs); and the ModelServer CRD itself."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from kubetune.contracts.serving import parse_adapter
from kubetune.k8s.modelserver import ModelServerSpec, render_model_server
from kubetune.k8s.validate import validate_objects
from kubetune.operator.modelserver_crd import check_model_server, crd, printer_columns

SPEC = {
    "base": {"model": "meta-llama/Llama-3.1-8B-Instruct", "revision": "main"},
    "replicas": 2,
    "maxLoras": 4,
    "autoscaling": {"metric": "cpu", "maxReplicas": 6},
    "adapterStorage": {"size": "20Gi", "retention": "Retain"},
}


def _objects(spec: dict = SPEC, adapters: list[str] | None = None) -> list[dict]:
    return render_model_server("llama8b", "team-a", ModelServerSpec.from_dict(spec), adapters or [])


def _one(objects: list[dict], kind: str) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


def test_the_server_serves_the_base_with_runtime_adapters_from_the_registry():
    objects = _objects(adapters=["cardio@v1", "cardio"])
    assert [o["kind"] for o in objects] == [
        "PersistentVolumeClaim", "NetworkPolicy", "Deployment", "Service", "PodDisruptionBudget",
        "HorizontalPodAutoscaler", "InferencePool", "InferenceObjective", "InferenceObjective",
    ]  # fmt: skip
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    assert server["command"][:3] == ["kubetune", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert server["command"][server["command"].index("native") + 1 :] == [
        "--allow-runtime-adapters", "--adapter-registry", "/adapters/registry.json", "--adapter-root", "/adapters",
        "--max-loras", "4",
    ]  # fmt: skip
    # every request needs the server's key, the runtime adapter routes included: from its Secret
    (key_env,) = [e for e in server["env"] if e["name"] == "KUBETUNE_API_KEY"]
    assert key_env["valueFrom"]["secretKeyRef"] == {"name": "llama8b-api-key", "key": "api-key"}
    assert {"name": "data", "mountPath": "/adapters", "subPath": "adapters"} in server["volumeMounts"]
    claim = _one(objects, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "llama8b-data" == pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # replicas and export Jobs share it
    assert _one(objects, "HorizontalPodAutoscaler")["spec"]["maxReplicas"] == 6


def test_every_object_validates_against_its_schema():
    assert validate_objects(_objects(adapters=["cardio@v1", "cardio", "radio@v3"])) == []


def test_the_gateway_objects_are_checked_not_waved_through():
    pool = _one(_objects(), "InferencePool")
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = [{"number": "http"}]
    assert any("targetPorts" in p for p in validate_objects([broken]))
    objective = next(o for o in _objects(adapters=["cardio@v1"]) if o["kind"] == "InferenceObjective")
    del objective["spec"]["poolRef"]
    assert any("poolRef" in p for p in validate_objects([objective]))


def test_the_pool_selects_the_servers_pods_and_each_objective_names_its_adapter():
    objects = _objects(adapters=["cardio@v2"])
    pool, objective = _one(objects, "InferencePool"), _one(objects, "InferenceObjective")
    assert pool["spec"]["selector"]["matchLabels"] == _one(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    assert objective["metadata"]["name"] == "cardio-v2"
    assert objective["metadata"]["annotations"]["kubetune.io/served-model"] == "cardio@v2"
    assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    assert not [o for o in _objects({**SPEC, "gateway": {"enabled": False}}, ["cardio@v2"]) if "Inference" in o["kind"]]


def test_spec_problems_name_the_field():
    bad = ModelServerSpec.from_dict({"base": {}, "maxLoras": 0, "weights": {"cardio": {"v1": 90, "v2": 20}}})
    assert bad.problems() == [
        "spec.base.model: the base model every adapter was trained on (a hub id or a path under /data)",
        "spec.maxLoras 0: adapters resident at once per replica, at least 1",
        "spec.weights.cardio: the versions' weights add up to 100 (got 110)",
    ]


def _server(spec: dict) -> dict:
    return {"apiVersion": "kubetune.io/v1alpha1", "kind": "ModelServer", "metadata": {"name": "x"}, "spec": spec}


def test_the_crd_is_strict_and_valid():
    kubernetes_validate.validate(crd(), "1.35.0", strict=True)
    assert check_model_server(_server(SPEC)) == []
    typo = copy.deepcopy(SPEC)
    typo["maxLora"] = 3
    assert check_model_server(_server(typo)) == ['unknown field "spec.maxLora"']
    assert check_model_server(_server({"base": {"model": "m"}, "replicas": 0})) == [
        "spec.replicas: 0 is less than the minimum of 1"
    ]
    assert any("'base' is a required property" in p for p in check_model_server(_server({})))


@pytest.mark.parametrize("column", ["Base", "Ready", "Adapters"])
def test_kubectl_get_shows_the_base_ready_replicas_and_adapter_count(column):
    paths = {c["name"]: c["jsonPath"] for c in printer_columns()}
    assert paths[column] in (".spec.base.model", ".status.readyReplicas", ".status.adapterCount")
    assert crd()["spec"]["versions"][0]["additionalPrinterColumns"] == printer_columns()


def test_render_serve_gateway_routes_the_run_and_each_adapter(cli, tmp_path):
    """`render-serve --gateway`: the same pool and objectives for a run's own server."""
    from .test_render_serve import SMOL, rendered

    plain = rendered()
    objects = rendered(gateway=True, adapters=(parse_adapter("qv=runs/qv"),))
    assert [o["kind"] for o in objects.objects][len(plain.objects) :] == [
        "InferencePool", "InferenceObjective", "InferenceObjective"
    ]  # fmt: skip
    served = [o["metadata"]["annotations"]["kubetune.io/served-model"] for o in objects.objects[-2:]]
    assert served == [objects.names.job.removesuffix("-serve"), "qv"]
    assert validate_objects(objects.objects) == []
    result = cli("k8s", "render-serve", SMOL, "--gateway", "--profile", "cpu", "-o", str(tmp_path))
    assert result.code == 0, result.err
    kinds = [yaml.safe_load(p.read_text())["kind"] for p in sorted(tmp_path.glob("*.yaml"))]
    assert kinds.count("InferencePool") == 1 and kinds.count("InferenceObjective") == 1
