"""The kubetune-operator chart: lint, render, validate, the CRD from its one source, the operator's pod and RBAC,
Helm's conventions (release-scoped names, the standard labels, image values, the `helm test` hooks).

(The cluster components' equality with `kubetune k8s render-components` is tests/charts/test_components_chart.py.)
"""

from __future__ import annotations

import re
import runpy
import sys

import helm_python
import kubernetes_validate
import pytest

from kubetune.k8s.validate import KUBERNETES_VERSION, validate_objects
from kubetune.operator.crd import CRD_FILE, crd

from .helm import OPERATOR_CHART, REPO, by_key, chart, installed, objects, render, without_helm_labels

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
DIGEST = "sha256:" + "0123456789abcdef" * 4
PINNED = {  # every image value given, by digest or by tag, and a name prefix of the user's
    "fullnameOverride": "ktune",
    "image": {"repository": "registry.example.com/kubetune", "digest": DIGEST, "pullPolicy": "Always"},
    "components": {
        **ALL_ON["components"],
        "image": {"repository": "registry.example.com/kubetune", "tag": "0.2.0-hpu"},
    },
    "tests": {"image": {"repository": "registry.example.com/kubectl", "tag": "v1.34.2"}, "timeout": "5m"},
}
CASES = {"defaults": {}, "every component": ALL_ON, "two namespaces": NAMESPACED, "pinned images": PINNED}
# helm.render installs the release `kt`: the chart's objects are named kt-kubetune-operator[-SUFFIX]
OPERATOR = "kt-kubetune-operator"


def operator_deployment(values: dict) -> dict:
    (deployment,) = [o for o in objects(OPERATOR_CHART, values) if o["kind"] == "Deployment" and
                     o["metadata"]["name"] == values.get("fullnameOverride", OPERATOR)]  # fmt: skip
    return deployment


def containers(obj: dict) -> list[dict]:
    pod = obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]
    return pod.get("initContainers", []) + pod["containers"]


@pytest.mark.parametrize("case", CASES)
def test_lint_finds_nothing(case):
    report = helm_python.lint(str(OPERATOR_CHART), CASES[case], strict=True, namespace="kubetune-system")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # no warning either (strict)


def test_every_template_renders_objects_with_every_component_on():
    rendered = render(OPERATOR_CHART, ALL_ON)
    # the DRA driver takes the device plugin's place: it renders with the plugin off (tests/cluster/test_dra_chart.py)
    dra = {"devicePlugin": {"enabled": False}, "draDriver": {"enabled": True}}
    dra_on = {"components": {**ALL_ON["components"], **dra}}
    rendered.update({p: t for p, t in render(OPERATOR_CHART, dra_on).items() if p.endswith("/dra-driver.yaml")})
    templates = [t["name"] for t in chart(OPERATOR_CHART).templates if not t["name"].rsplit("/")[-1].startswith("_")]
    empty = [t for t in templates if t.endswith(".yaml") and not rendered[f"kubetune-operator/{t}"]]
    assert templates and empty == []


def test_the_defaults_render_the_operator_alone():
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in installed(objects(OPERATOR_CHART, {})))
    assert kinds == [
        ("ClusterRole", OPERATOR),
        ("ClusterRole", f"{OPERATOR}-cluster"),
        ("ClusterRoleBinding", OPERATOR),
        ("ClusterRoleBinding", f"{OPERATOR}-cluster"),
        ("Deployment", OPERATOR),
        ("ServiceAccount", OPERATOR),
    ]


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_object_validates(case):
    # kubernetes-validate strict for the core kinds (unknown fields are errors); anything it has no schema for
    # is reported as uncheckable by validate_objects, never passed silently
    assert validate_objects(objects(OPERATOR_CHART, CASES[case])) == []


def test_the_crds_are_kubetunes_generated_crds():
    from kubetune.operator import modelserver_crd

    shipped = {c["filename"]: helm_python.values_from_yaml(c["data"]) for c in chart(OPERATOR_CHART).crds}
    assert shipped == {
        f"kubetune-operator/crds/{CRD_FILE}": crd(),
        f"kubetune-operator/crds/{modelserver_crd.CRD_FILE}": modelserver_crd.crd(),
    }


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
    where = monitoring.get("namespace", namespace)
    expected = [prometheus_rule(where, "prometheus"), *dashboard_config_maps(where, "prometheus")]
    # the release-scoped names are kubetune-alerts, kubetune-training-dashboard, ... with this override; the labels
    # Helm's conventions add (its managed-by: Helm, where kubetune's Python writes kubetune) are not compared, and
    # the chart labels every object part-of kubetune, which `monitor render` leaves out
    values["fullnameOverride"] = "kubetune"
    rendered = render(OPERATOR_CHART, values, namespace=namespace)["kubetune-operator/templates/monitoring.yaml"]
    for obj in expected:
        obj["metadata"]["labels"]["app.kubernetes.io/part-of"] = "kubetune"
    assert by_key(without_helm_labels(rendered)) == by_key(without_helm_labels(expected))


def test_the_crds_validate_as_custom_resource_definitions():
    for shipped in chart(OPERATOR_CHART).crds:
        kubernetes_validate.validate(helm_python.values_from_yaml(shipped["data"]), KUBERNETES_VERSION, strict=True)


def test_the_operator_watches_every_namespace_by_default():
    (container,) = operator_deployment({})["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["kubetune", "pod"]
    assert container["args"][:2] == ["operator", "--all-namespaces"]
    bindings = [o for o in installed(objects(OPERATOR_CHART, {})) if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert {(b["kind"], b["roleRef"]["name"]) for b in bindings} == {
        ("ClusterRoleBinding", OPERATOR),
        ("ClusterRoleBinding", f"{OPERATOR}-cluster"),
    }


def test_watched_namespaces_get_a_flag_and_a_role_binding_each():
    (container,) = operator_deployment(NAMESPACED)["spec"]["template"]["spec"]["containers"]
    assert container["args"][:3] == ["operator", "--namespace=team-a", "--namespace=team-b"]
    assert "--all-namespaces" not in container["args"]
    rendered = installed(objects(OPERATOR_CHART, NAMESPACED))
    bindings = [o for o in rendered if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    # the operator's own rules bound in its namespaces only; only kopf's cluster-wide needs stay cluster-wide
    assert sorted((b["kind"], b["metadata"].get("namespace"), b["roleRef"]["name"]) for b in bindings) == [
        ("ClusterRoleBinding", None, f"{OPERATOR}-cluster"),
        ("RoleBinding", "team-a", OPERATOR),
        ("RoleBinding", "team-b", OPERATOR),
    ]
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": OPERATOR, "namespace": "kubetune-system"}]


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
    assert {tuple(argv[1:3]) for _, _, argv in containers} == {
        ("pod", name) for name in ("operator", "device-plugin", "scheduler-extender", "netprobe")
    }
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
    group = container["command"][1]
    operator = typer.main.get_command(cli.app).commands[group].commands[container["args"][0]]  # typer's click
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


# Helm's conventions

STANDARD_LABELS = {f"app.kubernetes.io/{k}" for k in ("name", "instance", "version", "component", "managed-by",
                                                      "part-of")} | {"helm.sh/chart"}  # fmt: skip
SELECTOR_LABELS = {"app.kubernetes.io/name", "app.kubernetes.io/instance"}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding"}  # what this chart renders outside any namespace


def cluster_scoped(objs: list[dict]) -> set[tuple[str, str]]:
    out = {(o["kind"], o["metadata"]["name"]) for o in objs if "namespace" not in o["metadata"]}
    assert {kind for kind, _ in out} <= CLUSTER_SCOPED  # a namespaced object without its namespace fails here
    return out


@pytest.mark.parametrize("case", ["defaults", "every component", "two namespaces"])
def test_two_releases_share_no_cluster_scoped_name(case):
    first = cluster_scoped(objects(OPERATOR_CHART, CASES[case], name="first", namespace="ops-a"))
    second = cluster_scoped(objects(OPERATOR_CHART, CASES[case], name="second", namespace="ops-b"))
    assert first and len(first) == len(second)
    assert first & second == set()


def test_two_releases_in_one_namespace_share_no_object():
    first = objects(OPERATOR_CHART, ALL_ON, name="first", namespace="ops")
    second = objects(OPERATOR_CHART, ALL_ON, name="second", namespace="ops")
    assert by_key(first + second)  # raises on any (apiVersion, kind, namespace, name) rendered twice


def test_a_long_release_name_is_cut_to_a_dns_label():
    names = {o["metadata"]["name"] for o in objects(OPERATOR_CHART, ALL_ON, name="r" * 70)}
    assert max(len(n) for n in names) == 63
    assert not any(n.endswith("-") for n in names)


def pod_templates(objs: list[dict]) -> list[dict]:
    return [o["spec"]["template"] for o in objs if "template" in o.get("spec", {})]


@pytest.mark.parametrize("case", CASES)
def test_every_object_and_pod_template_has_the_standard_labels(case):
    version = chart(OPERATOR_CHART).metadata["appVersion"]
    objs = objects(OPERATOR_CHART, CASES[case], name="rel")
    for obj in objs + pod_templates(objs):
        labels = obj["metadata"]["labels"]
        assert set(labels) >= STANDARD_LABELS, obj["metadata"]
        assert (labels["app.kubernetes.io/instance"], labels["app.kubernetes.io/managed-by"]) == ("rel", "Helm")
        assert labels["app.kubernetes.io/version"] == version
        assert labels["helm.sh/chart"] == f"kubetune-operator-{chart(OPERATOR_CHART).metadata['version']}"


def selectors(obj: dict) -> list[dict]:
    spec = obj.get("spec", {})
    if obj["kind"] == "Service":
        return [spec["selector"]]
    return [spec["selector"]["matchLabels"]] if "selector" in spec else []


def test_selectors_pick_the_release_and_component_and_never_a_version():
    # selectors are immutable: a version in one would fail every `helm upgrade` to a new version
    objs = installed(objects(OPERATOR_CHART, ALL_ON, name="rel"))
    pods = {o["metadata"]["labels"]["app.kubernetes.io/name"]: o["metadata"]["labels"] for o in pod_templates(objs)}
    found = 0
    for obj in objs:
        for selector in selectors(obj):
            found += 1
            assert set(selector) == SELECTOR_LABELS, obj["metadata"]["name"]
            assert selector["app.kubernetes.io/instance"] == "rel"
            assert selector.items() <= pods[selector["app.kubernetes.io/name"]].items()  # it selects its pods
    assert found == 7  # 2 Deployments, 2 DaemonSets, the Service, the PodMonitor and the ServiceMonitor


def image_of(values: dict, kind: str, name_suffix: str = "") -> dict:
    name = values.get("fullnameOverride", OPERATOR) + name_suffix
    (obj,) = [o for o in objects(OPERATOR_CHART, values) if (o["kind"], o["metadata"]["name"]) == (kind, name)]
    (container, *others) = containers(obj)
    assert all(c["image"] == container["image"] for c in others)
    return {k: v for k, v in container.items() if k in ("image", "imagePullPolicy")}


def test_the_image_tag_defaults_to_the_charts_app_version():
    version = chart(OPERATOR_CHART).metadata["appVersion"]
    values = {"image": {"repository": "registry.example.com/kubetune"}, **ALL_ON}
    expected = f"registry.example.com/kubetune:{version}"
    assert image_of(values, "Deployment") == {"image": expected, "imagePullPolicy": "IfNotPresent"}
    # the components run the same image; their pull policy is left to Kubernetes, as render-components does
    assert image_of(values, "DaemonSet", "-device-plugin") == {"image": expected}


def test_a_digest_wins_over_the_tag_and_the_components_follow_image_unless_given_their_own():
    values = {"image": {"repository": "r.example/kt", "tag": "9.9", "digest": DIGEST}, **ALL_ON}
    assert image_of(values, "Deployment")["image"] == f"r.example/kt@{DIGEST}"
    assert image_of(values, "DaemonSet", "-netprobe")["image"] == f"r.example/kt@{DIGEST}"
    assert image_of(PINNED, "Deployment") == {"image": f"registry.example.com/kubetune@{DIGEST}",
                                              "imagePullPolicy": "Always"}  # fmt: skip
    assert image_of(PINNED, "Deployment", "-scheduler-extender") == {"image": "registry.example.com/kubetune:0.2.0-hpu"}
    assert image_of(PINNED, "Pod", "-test") == {"image": "registry.example.com/kubectl:v1.34.2",
                                                "imagePullPolicy": "IfNotPresent"}  # fmt: skip


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"image": "ghcr.io/kubetune/kubetune:0.2.0"},
            "--set image.repository=ghcr.io/kubetune/kubetune --set image.tag=0.2.0",
        ),
        ({"imagePullPolicy": "Always"}, "imagePullPolicy: it is image.pullPolicy now"),
        ({"components": {"image": "ghcr.io/kubetune/kubetune:0.2.0"}}, "write components.image.repository"),
    ],
)
def test_the_old_spellings_are_refused_with_the_new_one(values, message):
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        render(OPERATOR_CHART, values)


@pytest.mark.parametrize("image", [{"repository": "ghcr.io/kubetune/kubetune:0.1.0"}, {"digest": "0123abc"}])
def test_an_image_value_with_its_parts_mixed_up_is_refused(image):
    with pytest.raises(helm_python.HelmValuesError, match="/image"):
        render(OPERATOR_CHART, {"image": image})


def hooks(values: dict) -> list[dict]:
    return [o for o in objects(OPERATOR_CHART, values) if o not in installed([o])]


@pytest.mark.parametrize("case", CASES)
def test_helm_test_hooks_are_test_hooks_deleted_when_they_pass(case):
    found = hooks(CASES[case])
    assert sorted(o["kind"] for o in found) == ["Pod", "Role", "RoleBinding", "ServiceAccount"]
    weights = {}
    for obj in found:
        notes = obj["metadata"]["annotations"]
        assert (notes["helm.sh/hook"], notes["helm.sh/hook-delete-policy"]) == (
            "test", "before-hook-creation,hook-succeeded")  # fmt: skip
        weights[obj["kind"]] = int(notes.get("helm.sh/hook-weight", "0"))
    assert max(weights[k] for k in ("ServiceAccount", "Role", "RoleBinding")) < weights["Pod"]  # RBAC first


def checks(values: dict) -> list[list[str]]:
    """kubectl's arguments in each container of the `helm test` pod."""
    (pod,) = [o for o in hooks(values) if o["kind"] == "Pod"]
    return [c["args"] for c in containers(pod)]


@pytest.mark.parametrize("case", CASES)
def test_the_test_pod_checks_every_workload_the_release_installs(case):
    values = CASES[case]
    installed_objs = installed(objects(OPERATOR_CHART, values))
    workloads = {f"{o['kind'].lower()}/{o['metadata']['name']}" for o in installed_objs
                 if o["kind"] in ("Deployment", "DaemonSet")}  # fmt: skip
    checked = {arg for args in checks(values) for arg in args if arg.startswith(("deployment/", "daemonset/"))}
    assert checked == workloads
    assert ["get", "finetunes.kubetune.io", "-n", "kubetune-system"] in checks(values)


def test_the_test_pod_asks_the_extenders_service_for_healthz_on_a_port_it_has():
    (raw,) = [args[-1] for args in checks(ALL_ON) if args[:2] == ["get", "--raw"]]
    match = re.fullmatch(r"/api/v1/namespaces/([^/]+)/services/([^/:]+):([^/]+)/proxy/healthz", raw)
    assert match, raw
    namespace, service, port = match.groups()
    services = [o for o in installed(objects(OPERATOR_CHART, ALL_ON)) if o["kind"] == "Service"]
    (svc,) = [s for s in services if (s["metadata"]["namespace"], s["metadata"]["name"]) == (namespace, service)]
    assert port in {p["name"] for p in svc["spec"]["ports"]}
    (role,) = [o for o in hooks(ALL_ON) if o["kind"] == "Role"]
    (proxy,) = [r for r in role["rules"] if r["resources"] == ["services/proxy"]]
    assert proxy["resourceNames"] == [f"{service}:{port}"]  # RBAC matches the proxy's whole name
    assert not [args for args in checks({}) if args[:2] == ["get", "--raw"]]  # no extender, no check


@pytest.mark.parametrize("case", CASES)
def test_the_test_pod_may_only_read(case):
    (role,) = [o for o in hooks(CASES[case]) if o["kind"] == "Role"]
    assert {verb for rule in role["rules"] for verb in rule["verbs"]} <= {"get", "list", "watch"}
    (binding,) = [o for o in hooks(CASES[case]) if o["kind"] == "RoleBinding"]
    (pod,) = [o for o in hooks(CASES[case]) if o["kind"] == "Pod"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == pod["spec"]["serviceAccountName"]


@pytest.mark.parametrize("release", ["kubetune-operator", "team-a"])
def test_the_notes_commands_name_the_releases_deployment(release):
    notes = chart(OPERATOR_CHART).render({}, name=release, namespace="ops")["kubetune-operator/templates/NOTES.txt"]
    named = set(re.findall(r"deployment/(\S+)", notes))
    rendered = objects(OPERATOR_CHART, {}, name=release)
    deployments = {o["metadata"]["name"] for o in rendered if o["kind"] == "Deployment"}
    assert named == deployments
    assert f"helm test {release} -n ops" in notes
