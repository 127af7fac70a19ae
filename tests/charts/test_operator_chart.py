"""The kubetune-operator chart: lint, render, validate, the CRD from its one source, the operator's pod and RBAC.

(The cluster components' equality with `kubetune k8s render-components` is tests/charts/test_components_chart.py.)
"""

from __future__ import annotations

import runpy
import sys

import helm_python
import kubernetes_validate
import pytest

from kubetune.k8s.validate import KUBERNETES_VERSION, validate_objects
from kubetune.operator.crd import CRD_FILE, crd

from .helm import OPERATOR_CHART, REPO, by_key, chart, objects, render

ALL_ON = {
    "components": {
        "devicePlugin": {"enabled": True},
        "schedulerExtender": {"enabled": True},
        "netprobe": {"enabled": True},
        "monitors": {"enabled": True},
    },
    "monitoring": {"enabled": True},
}
NAMESPACED = {"operator": {"watchNamespaces": ["team-a", "team-b"]}}
CASES = {"defaults": {}, "every component": ALL_ON, "two namespaces": NAMESPACED}


def operator_deployment(values: dict) -> dict:
    (deployment,) = [o for o in objects(OPERATOR_CHART, values) if o["kind"] == "Deployment" and
                     o["metadata"]["name"] == "kubetune-operator"]  # fmt: skip
    return deployment


@pytest.mark.parametrize("case", CASES)
def test_lint_finds_nothing(case):
    report = helm_python.lint(str(OPERATOR_CHART), CASES[case], strict=True, namespace="kubetune-system")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # no warning either (strict)


def test_every_template_renders_objects_with_every_component_on():
    rendered = render(OPERATOR_CHART, ALL_ON)
    templates = [t["name"] for t in chart(OPERATOR_CHART).templates if not t["name"].rsplit("/")[-1].startswith("_")]
    empty = [t for t in templates if t.endswith(".yaml") and not rendered[f"kubetune-operator/{t}"]]
    assert templates and empty == []


def test_the_defaults_render_the_operator_alone():
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objects(OPERATOR_CHART, {}))
    assert kinds == [
        ("ClusterRole", "kubetune-operator"),
        ("ClusterRole", "kubetune-operator-cluster"),
        ("ClusterRoleBinding", "kubetune-operator"),
        ("ClusterRoleBinding", "kubetune-operator-cluster"),
        ("Deployment", "kubetune-operator"),
        ("ServiceAccount", "kubetune-operator"),
    ]


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_object_validates(case):
    # kubernetes-validate strict for the core kinds (unknown fields are errors); anything it has no schema for
    # is reported as uncheckable by validate_objects, never passed silently
    assert validate_objects(objects(OPERATOR_CHART, CASES[case])) == []


def test_the_crd_is_kubetunes_generated_crd():
    (shipped,) = chart(OPERATOR_CHART).crds
    assert shipped["filename"] == f"kubetune-operator/crds/{CRD_FILE}"
    assert helm_python.values_from_yaml(shipped["data"]) == crd()


def test_every_copied_file_equals_the_code_that_makes_it():
    # the CRD, the alert rules and the dashboards, byte for byte (the script's message says how to regenerate)
    argv = sys.argv
    sys.argv = ["chart_files.py", "--check"]
    try:
        with pytest.raises(SystemExit) as exit:
            runpy.run_path(str(REPO / "scripts" / "chart_files.py"), run_name="__main__")
    finally:
        sys.argv = argv
    assert exit.value.code == 0


@pytest.mark.parametrize(("namespace", "monitoring"), [("monitoring", {}), ("kubetune-system", {"namespace": "obs"})])
def test_the_rules_and_dashboards_are_what_kubetune_monitor_render_renders(namespace, monitoring):
    from kubetune.monitor.objects import dashboard_config_maps, prometheus_rule

    values = {"monitoring": {"enabled": True, "release": "prometheus", **monitoring}}
    rendered = render(OPERATOR_CHART, values, namespace=namespace)["kubetune-operator/templates/monitoring.yaml"]
    where = monitoring.get("namespace", namespace)
    expected = [prometheus_rule(where, "prometheus"), *dashboard_config_maps(where, "prometheus")]
    assert by_key(rendered) == by_key(expected)


def test_the_crd_validates_as_a_custom_resource_definition():
    (shipped,) = chart(OPERATOR_CHART).crds
    kubernetes_validate.validate(helm_python.values_from_yaml(shipped["data"]), KUBERNETES_VERSION, strict=True)


def test_the_operator_watches_every_namespace_by_default():
    (container,) = operator_deployment({})["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["kubetune"]
    assert container["args"][:2] == ["operator", "--all-namespaces"]
    bindings = [o for o in objects(OPERATOR_CHART, {}) if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert {(b["kind"], b["roleRef"]["name"]) for b in bindings} == {
        ("ClusterRoleBinding", "kubetune-operator"),
        ("ClusterRoleBinding", "kubetune-operator-cluster"),
    }


def test_watched_namespaces_get_a_flag_and_a_role_binding_each():
    (container,) = operator_deployment(NAMESPACED)["spec"]["template"]["spec"]["containers"]
    assert container["args"][:3] == ["operator", "--namespace=team-a", "--namespace=team-b"]
    assert "--all-namespaces" not in container["args"]
    bindings = [o for o in objects(OPERATOR_CHART, NAMESPACED) if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    # the operator's own rules bound in its namespaces only; only kopf's cluster-wide needs stay cluster-wide
    assert sorted((b["kind"], b["metadata"].get("namespace"), b["roleRef"]["name"]) for b in bindings) == [
        ("ClusterRoleBinding", None, "kubetune-operator-cluster"),
        ("RoleBinding", "team-a", "kubetune-operator"),
        ("RoleBinding", "team-b", "kubetune-operator"),
    ]
    for b in bindings:
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": "kubetune-operator", "namespace": "kubetune-system"}
        ]


def test_the_operator_runs_kubetunes_cpu_image_and_is_probed_where_kopf_answers():
    from kubetune.recipe.k8s import PROFILE_IMAGES

    pod = operator_deployment({})["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == PROFILE_IMAGES["cpu"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    probe = container["livenessProbe"]["httpGet"]
    (port,) = [p for p in container["ports"] if p["name"] == probe["port"]]
    assert (probe["path"], port["containerPort"]) == ("/healthz", 8080)


def test_every_container_runs_a_command_its_image_installs():
    # the image the chart names must install what its command imports (tests/k8s/imagecheck.py reads both sides
    # from the sources): e.g. `kubetune operator` needs kopf, the `operator` extra
    pytest.importorskip("grpc")  # the component commands' imports are resolved in this environment
    from ..k8s.imagecheck import dockerfile_tags, problems
    from ..k8s.test_images_and_layers import DOCKERFILES

    tags = dockerfile_tags(DOCKERFILES)
    containers = [
        (f"{o['kind']}/{o['metadata']['name']}", c["image"], c["command"] + c.get("args", []))
        for o in objects(OPERATOR_CHART, ALL_ON)
        if o["kind"] in ("Deployment", "DaemonSet")
        for c in o["spec"]["template"]["spec"]["containers"]
    ]
    assert {argv[1] for _, _, argv in containers} == {"operator", "device-plugin", "scheduler-extender", "netprobe"}
    found = []
    for where, image, argv in containers:
        tag = image.rpartition(":")[2]
        assert tag in tags, f"{where}: no Dockerfile builds {image}"
        found += [f"{where}: {p}" for p in problems(argv, REPO / tags[tag])]
    assert found == []


@pytest.mark.parametrize("case", CASES)
def test_kubetune_operator_accepts_every_argument_the_pod_passes(case):
    # parsed by the real command line, not run: a flag the command lacks would crash-loop the pod
    import typer.main

    from kubetune import cli

    (container,) = operator_deployment(CASES[case])["spec"]["template"]["spec"]["containers"]
    operator = typer.main.get_command(cli.app).commands[container["args"][0]]  # typer vendors click: duck-typed
    operator.make_context("operator", list(container["args"][1:]))  # raises on an unknown option or a bad value


def test_the_liveness_flag_reaches_kopf(monkeypatch):
    # what the pod's livenessProbe polls is served by kopf only if `--liveness` reaches kopf.operator
    import kopf

    from kubetune.operator import main

    seen = {}

    async def operator(**kwargs):
        seen.update(kwargs)

    monkeypatch.setattr(kopf, "operator", operator)
    main.run_operator(["team-a"], liveness="http://0.0.0.0:8080/healthz")
    assert seen["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    assert (seen["namespaces"], seen["clusterwide"], seen["standalone"]) == (["team-a"], False, True)
