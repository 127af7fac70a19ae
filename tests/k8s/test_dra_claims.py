"""k8s.devices=dra: the rendered ResourceClaimTemplates, their CEL selectors evaluated on the
ResourceSlices the DRA driver publishes (`cluster.dra.slices.build_slices`), the pods that claim
them, and the refusals (cpu profile, clusters before 1.34)."""

from __future__ import annotations

from collections import defaultdict

import celpy
import kubernetes_validate
import pytest
from celpy import celtypes

from kubetune.cluster.devices.discovery import HEALTHY, UNHEALTHY, Card
from kubetune.cluster.dra.slices import build_slices
from kubetune.cluster.manifests import device_class
from kubetune.contracts import dra
from kubetune.contracts.kube import parse_quantity
from kubetune.errors import UserError
from kubetune.k8s.render import render
from kubetune.k8s.serve.render import render_serve
from kubetune.k8s.serve.settings import ServeSettings
from kubetune.k8s.validate import validate_objects
from kubetune.recipe.loader import load_recipe

RECIPE = "smollm2-135m-lora-cpu"
GAUDI, NVIDIA = dra.VENDORS["gaudi"], dra.VENDORS["nvidia"]
GIB_MIB = 1024


def _recipe(*overrides: str):
    return load_recipe(RECIPE, list(overrides)).recipe


def _gaudi(*overrides: str):
    return _recipe("k8s.profile=gaudi", "k8s.devices=dra", *overrides)


def _kind(objects: list[dict], kind: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def _template(objects: list[dict]) -> dict:
    return _kind(objects, "ResourceClaimTemplate")


def _request(template: dict) -> dict:
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    return request


# ---------------------------------------------------------------------------- CEL, as the scheduler runs it

# Kubernetes' CEL has a Quantity type (quantity("80Gi"), q.compareTo(other)) that celpy does not:
# it is provided here as two custom functions over kubetune.contracts.kube.parse_quantity, the parser
# kubetune reads every quantity with. A capacity value stays a Quantity, not a string, so that
# a selector comparing it as a string (or a number) fails here as it would in the scheduler.


class Quantity(celtypes.StringType):
    pass


def _quantity(text: celtypes.StringType) -> Quantity:
    parse_quantity(str(text))  # a malformed literal is an error, as in Kubernetes
    return Quantity(str(text))


def _compare_to(a: Quantity, b: Quantity) -> celtypes.IntType:
    if not (isinstance(a, Quantity) and isinstance(b, Quantity)):
        raise TypeError(f"compareTo needs two quantities, got {type(a).__name__} and {type(b).__name__}")
    x, y = parse_quantity(str(a)), parse_quantity(str(b))
    return celtypes.IntType((x > y) - (x < y))


FUNCTIONS = {"quantity": _quantity, "compareTo": _compare_to}


class DomainMap(celtypes.MapType):
    """device.attributes / device.capacity: an unknown domain is an empty map (Kubernetes' rule),
    so `has(device.attributes["x"].y)` is false there rather than an error."""

    def __getitem__(self, key):
        try:
            return super().__getitem__(key)
        except KeyError:
            return celtypes.MapType()


def _attribute_value(value: dict):
    ((kind, raw),) = value.items()
    return {"string": celtypes.StringType, "int": celtypes.IntType, "bool": celtypes.BoolType}[kind](raw)


def _split(driver: str, name: str) -> tuple[str, str]:
    domain, _, short = name.rpartition("/")
    return domain or driver, short


def cel_device(driver: str, device: dict) -> celtypes.MapType:
    """One ResourceSlice device as the `device` variable of a selector."""
    attributes: dict = defaultdict(dict)
    for name, value in device.get("attributes", {}).items():
        domain, short = _split(driver, name)
        attributes[domain][celtypes.StringType(short)] = _attribute_value(value)
    capacity: dict = defaultdict(dict)
    for name, value in device.get("capacity", {}).items():
        domain, short = _split(driver, name)
        capacity[domain][celtypes.StringType(short)] = Quantity(value["value"])
    return celtypes.MapType(
        {
            celtypes.StringType("driver"): celtypes.StringType(driver),
            celtypes.StringType("attributes"): DomainMap(
                {celtypes.StringType(d): celtypes.MapType(a) for d, a in attributes.items()}
            ),
            celtypes.StringType("capacity"): DomainMap(
                {celtypes.StringType(d): celtypes.MapType(c) for d, c in capacity.items()}
            ),
            celtypes.StringType("allowMultipleAllocations"): celtypes.BoolType(False),
        }
    )


_ENV = celpy.Environment()


def passes(expressions: list[str], driver: str, device: dict) -> bool:
    """All of `expressions` true on the device; anything but a bool fails the test (an error
    aborts the allocation in Kubernetes, which is never what a rendered selector should cause)."""
    for expression in expressions:
        result = _ENV.program(_ENV.compile(expression), functions=FUNCTIONS).evaluate(
            {"device": cel_device(driver, device)}
        )
        assert isinstance(result, celtypes.BoolType), f"{expression} gave {result!r}"
        if not result:
            return False
    return True


def device_class_selectors(vendor: dra.DraVendor) -> list[str]:
    """The selectors of the vendor's DeviceClass as `render-components --devices dra` ships it."""
    return [s["cel"]["expression"] for s in device_class(vendor)["spec"]["selectors"]]


def selected(template: dict, vendor: dra.DraVendor, slices: list[dict]) -> dict[str, list[str]]:
    """Node -> the devices the class and the request's selectors let through."""
    exactly = _request(template)["exactly"]
    assert exactly["deviceClassName"] == vendor.device_class
    expressions = device_class_selectors(vendor) + [s["cel"]["expression"] for s in exactly.get("selectors", [])]
    out: dict[str, list[str]] = defaultdict(list)
    for s in slices:
        for device in s["spec"]["devices"]:
            if passes(expressions, s["spec"]["driver"], device):
                out[s["spec"]["nodeName"]].append(device["name"])
    return dict(out)


def allocate(template: dict, vendor: dra.DraVendor, slices: list[dict]) -> dict[str, list[str]]:
    """Node -> the `count` devices the claim would get there: the selected devices, and with a
    matchAttribute constraint only `count` of them that all have the attribute and share its value
    (Kubernetes' rule: a device without the attribute fails the constraint). Nodes that cannot
    satisfy the claim are left out."""
    count = _request(template)["exactly"]["count"]
    constraints = template["spec"]["spec"]["devices"].get("constraints", [])
    devices = {(s["spec"]["nodeName"], d["name"]): d for s in slices for d in s["spec"]["devices"]}
    out = {}
    for node, names in selected(template, vendor, slices).items():
        groups = [sorted(names)]
        for constraint in constraints:
            key = constraint["matchAttribute"]
            short = key.removeprefix(f"{vendor.driver}/")  # the driver's own domain is written bare
            by_value: dict = defaultdict(list)
            for name in names:
                attribute = devices[(node, name)]["attributes"].get(short)
                if attribute is not None:
                    by_value[str(attribute)].append(name)
            groups = [sorted(group) for group in by_value.values()]
        fitting = [group[:count] for group in groups if len(group) >= count]
        if fitting:
            out[node] = fitting[0]
    return out


def _card(i: int, **facts) -> Card:
    """Card i of an 8-card Gaudi2 board: 96 GiB, cards 0-3 on NUMA node 0 and root pci0000:00, 4-7
    on node 1 and pci0000:10; `facts` replace any of these."""
    base = {
        "id": f"0000:{0x19 + i:02x}:00.0",
        "model": "gaudi2",
        "index": i,
        "hbm_mib": 96 * GIB_MIB,
        "numa_node": i // 4,
        "pcie_root": f"pci0000:{0x10 * (i // 4):02x}",
        "link_domain": "gaudi2-board",
    }
    return Card(**(base | facts))


def _healthy(cards: list[Card]) -> dict[str, str]:
    return {c.id: HEALTHY for c in cards}


# ------------------------------------------------------------------------------------- tests


def test_a_claimed_job_renders_a_template_the_pods_reference_and_no_card_limits():
    objects = render(_gaudi("k8s.resources.accelerators=4", "k8s.dra.model=gaudi2", "k8s.dra.min_memory=90Gi")).objects
    template = _template(objects)
    assert template["apiVersion"] == "resource.k8s.io/v1"
    assert template["metadata"]["name"] == f"{RECIPE}-cards"
    exactly = _request(template)["exactly"]
    assert (exactly["deviceClassName"], exactly["count"], exactly["allocationMode"]) == (
        GAUDI.device_class,
        4,
        "ExactCount",
    )
    # gaudi asks for one board unless k8s.dra.align says otherwise
    assert template["spec"]["spec"]["devices"]["constraints"] == [
        {"requests": ["cards"], "matchAttribute": f"{GAUDI.driver}/{dra.ATTR_LINK_DOMAIN}"}
    ]
    job = _kind(objects, "PyTorchJob")
    for role in job["spec"]["pytorchReplicaSpecs"].values():
        pod = role["template"]["spec"]
        assert pod["resourceClaims"] == [{"name": "cards", "resourceClaimTemplateName": template["metadata"]["name"]}]
        resources = pod["containers"][0]["resources"]
        assert resources["claims"] == [{"name": "cards"}]
        assert GAUDI.extended_resource not in resources["limits"] | resources["requests"]
    assert objects.index(template) < objects.index(job)  # the pods find it when they are created


@pytest.mark.parametrize("version", ["1.34.0", "1.37.0"])
def test_every_claimed_manifest_validates_strict(version):
    recipe = _gaudi("k8s.dra.model=gaudi2", "k8s.dra.min_memory=90Gi", "k8s.dra.align=pcie_root")
    objects = render(recipe).objects
    assert validate_objects(objects) == []  # core kinds (1.35) and the Kubeflow CRDs
    kubernetes_validate.validate(_template(objects), version, strict=True)
    # the claiming pod itself, as the API server of that version would take it
    pod_template = _kind(objects, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w", **pod_template["metadata"]}}
    kubernetes_validate.validate({**pod, "spec": pod_template["spec"]}, version, strict=True)
    served = render_serve(
        _recipe("k8s.profile=nvidia", "k8s.devices=dra", "k8s.dra.min_memory=80Gi"), ServeSettings(engine="vllm")
    ).objects
    assert validate_objects(served) == []
    for obj in (_template(served), _kind(served, "Deployment")):
        kubernetes_validate.validate(obj, version, strict=True)


def test_selectors_pick_the_model_and_memory_asked_for():
    cards = [
        _card(0),
        _card(1, model="gaudi3"),
        _card(2, hbm_mib=64 * GIB_MIB),
        _card(3, hbm_mib=None),  # memory unknown: not "enough", and no error either
        _card(4),
    ]
    slices = build_slices("node-a", "gaudi", cards, _healthy(cards), generation=1)
    one = ("k8s.resources.accelerators=1", "k8s.dra.model=gaudi2")
    assert selected(_template(render(_gaudi(*one)).objects), GAUDI, slices) == {
        "node-a": ["gaudi-0", "gaudi-2", "gaudi-3", "gaudi-4"]
    }
    enough = _template(render(_gaudi(*one, "k8s.dra.min_memory=90Gi")).objects)
    assert selected(enough, GAUDI, slices) == {"node-a": ["gaudi-0", "gaudi-4"]}
    exactly = _template(render(_gaudi(*one, "k8s.dra.min_memory=96Gi")).objects)  # >= : 96Gi itself is enough
    assert selected(exactly, GAUDI, slices) == {"node-a": ["gaudi-0", "gaudi-4"]}
    anything = _template(render(_gaudi("k8s.resources.accelerators=1")).objects)
    assert "selectors" not in _request(anything)["exactly"]
    assert selected(anything, GAUDI, slices) == {"node-a": [f"gaudi-{i}" for i in range(5)]}


def test_unhealthy_cards_are_left_out_by_the_device_class():
    cards = [_card(i) for i in range(4)]
    health = _healthy(cards) | {cards[1].id: UNHEALTHY}
    slices = build_slices("node-a", "gaudi", cards, health, generation=2)
    template = _template(render(_gaudi("k8s.resources.accelerators=3", "k8s.dra.model=gaudi2")).objects)
    assert allocate(template, GAUDI, slices) == {"node-a": ["gaudi-0", "gaudi-2", "gaudi-3"]}
    health[cards[2].id] = UNHEALTHY  # two cards left: a 3-card claim no longer fits
    assert allocate(template, GAUDI, build_slices("node-a", "gaudi", cards, health, generation=3)) == {}


def test_one_pcie_root_refuses_a_node_whose_cards_are_split_and_takes_one_whose_cards_share_it():
    split = [_card(i, pcie_root=f"pci0000:{0x10 * (i % 4):02x}") for i in range(8)]  # 2 cards per root
    shared = [_card(i) for i in range(8)]  # cards 0-3 on pci0000:00, 4-7 on pci0000:10
    slices = build_slices("split", "gaudi", split, _healthy(split), 1) + build_slices(
        "shared", "gaudi", shared, _healthy(shared), 1
    )
    one_root = _template(render(_gaudi("k8s.resources.accelerators=4", "k8s.dra.align=pcie_root")).objects)
    assert one_root["spec"]["spec"]["devices"]["constraints"] == [
        {"requests": ["cards"], "matchAttribute": dra.ATTR_PCIE_ROOT}
    ]
    assert allocate(one_root, GAUDI, slices) == {"shared": ["gaudi-0", "gaudi-1", "gaudi-2", "gaudi-3"]}
    # without the constraint both nodes would do: the refusal is the constraint's
    anywhere = _template(render(_gaudi("k8s.resources.accelerators=4", "k8s.dra.align=none")).objects)
    assert "constraints" not in anywhere["spec"]["spec"]["devices"]
    assert set(allocate(anywhere, GAUDI, slices)) == {"split", "shared"}
    # a card whose root is unknown cannot be shown to share it
    unknown = [_card(i, pcie_root=None if i == 0 else "pci0000:00") for i in range(4)]
    assert allocate(one_root, GAUDI, build_slices("n", "gaudi", unknown, _healthy(unknown), 1)) == {}


def test_numa_alignment_and_a_single_card_needs_no_constraint():
    numa = _template(render(_gaudi("k8s.resources.accelerators=2", "k8s.dra.align=numa_node")).objects)
    assert numa["spec"]["spec"]["devices"]["constraints"][0]["matchAttribute"] == f"{GAUDI.driver}/numaNode"
    cards = [_card(i, numa_node=i % 2) for i in range(4)]  # 0, 2 on node 0; 1, 3 on node 1
    assert allocate(numa, GAUDI, build_slices("n", "gaudi", cards, _healthy(cards), 1)) == {"n": ["gaudi-0", "gaudi-2"]}
    single = _template(render(_gaudi("k8s.resources.accelerators=1")).objects)  # the profile's link_domain
    assert "constraints" not in single["spec"]["spec"]["devices"]


def test_nvidia_claims_by_memory_and_asks_no_alignment_by_default():
    gpus = [
        Card(id="GPU-a", model="NVIDIA H100 80GB HBM3", index=0, hbm_mib=81559),
        Card(id="GPU-b", model="NVIDIA A100-SXM4-40GB", index=1, hbm_mib=40960),
    ]
    slices = build_slices("gpu-node", "nvidia", gpus, _healthy(gpus), 1)
    objects = render(_recipe("k8s.profile=nvidia", "k8s.devices=dra", "k8s.dra.min_memory=79Gi")).objects
    template = _template(objects)
    assert "constraints" not in template["spec"]["spec"]["devices"]
    assert allocate(template, NVIDIA, slices) == {"gpu-node": ["gpu-0"]}
    limits = _kind(objects, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert NVIDIA.extended_resource not in limits["containers"][0]["resources"]["limits"]


def test_a_namespace_quota_on_cards_is_said_to_miss_claimed_cards():
    rendered = render(_gaudi("k8s.namespace_quota.accelerators=16"))
    (said,) = [w for w in rendered.warnings if "namespace_quota" in w]
    assert said.startswith("k8s.namespace_quota.accelerators caps requests of habana.ai/gaudi, which pods that claim")
    assert said.endswith("the namespace quota counts none of this job's cards")


def test_a_claimed_server_references_its_own_template():
    recipe = _recipe("k8s.profile=nvidia", "k8s.devices=dra", "k8s.resources.accelerators=3", "k8s.dra.align=pcie_root")
    objects = render_serve(recipe, ServeSettings(engine="vllm")).objects
    template, deployment = _template(objects), _kind(objects, "Deployment")
    assert template["metadata"]["name"] == f"{RECIPE}-serve-cards"
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "server"  # `delete` finds it
    assert _request(template)["exactly"]["count"] == 3  # vLLM shards over 3 (a divisor of 9 heads)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["resourceClaims"] == [{"name": "cards", "resourceClaimTemplateName": f"{RECIPE}-serve-cards"}]
    assert pod["containers"][0]["resources"]["claims"] == [{"name": "cards"}]
    assert NVIDIA.extended_resource not in pod["containers"][0]["resources"]["limits"]
    assert objects.index(template) < objects.index(deployment)


def test_a_trainjob_claims_through_its_runtime():
    recipe = _gaudi("k8s.api=trainjob", "k8s.resources.accelerators=2")
    with_runtime = render(recipe, with_runtime=True).objects
    assert validate_objects(with_runtime) == []
    runtime_pod = _kind(with_runtime, "ClusterTrainingRuntime")["spec"]["template"]["spec"]["replicatedJobs"][0]
    claims = runtime_pod["template"]["spec"]["template"]["spec"]["resourceClaims"]
    assert claims == [{"name": "cards", "resourceClaimTemplateName": f"{RECIPE}-cards"}]
    trainer = _kind(with_runtime, "TrainJob")["spec"]["trainer"]
    assert trainer["resourcesPerNode"]["claims"] == [{"name": "cards"}]
    assert GAUDI.extended_resource not in trainer["resourcesPerNode"]["limits"]
    warnings = render(recipe).warnings  # a runtime of its own (k8s.runtime) must carry the claim
    assert any("resourceClaims (k8s.devices=dra)" in w and "--with-runtime" in w for w in warnings)


def test_the_device_plugin_path_is_the_default_and_unchanged_by_the_version():
    plain = render(_recipe("k8s.profile=gaudi")).objects
    on_133 = render(_recipe("k8s.profile=gaudi", "k8s.kubernetes_version='1.33'")).objects
    assert [o["kind"] for o in plain] == [o["kind"] for o in on_133]
    assert "ResourceClaimTemplate" not in {o["kind"] for o in plain}
    job = _kind(on_133, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert "resourceClaims" not in job and "claims" not in job["containers"][0]["resources"]
    assert job["containers"][0]["resources"]["limits"][GAUDI.extended_resource] == "8"
    # only the recipe the pods read (its ConfigMap) records the version
    differ = [a["kind"] for a, b in zip(plain, on_133) if a != b]
    assert differ == ["ConfigMap"]
    # a claim's keys on the plugin path change nothing, and say so
    unread = render(_recipe("k8s.profile=gaudi", "k8s.dra.model=gaudi2", "k8s.dra.min_memory=90Gi"))
    assert [o for o in unread.objects if o["kind"] != "ConfigMap"] == [o for o in plain if o["kind"] != "ConfigMap"]
    said = "k8s.dra.model, k8s.dra.min_memory: only claims read it, and k8s.devices=plugin requests whole cards"
    assert [w for w in unread.warnings if "k8s.dra" in w] == [f"{said}; set k8s.devices=dra"]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (("k8s.devices=dra",), "k8s.devices=dra with k8s.profile=cpu: DRA claims need accelerator cards"),
        (
            ("k8s.profile=gaudi", "k8s.devices=dra", "k8s.kubernetes_version='1.33'"),
            "k8s.devices=dra on k8s.kubernetes_version=1.33: DRA (resource.k8s.io/v1) needs Kubernetes 1.34",
        ),
    ],
)
def test_dra_is_refused_on_cpu_and_before_1_34_in_one_line(overrides, says):
    with pytest.raises(UserError) as e:
        render(_recipe(*overrides))
    (line,) = e.value.problems
    assert line.startswith(says) and "k8s.devices=plugin" in line
    with pytest.raises(UserError) as served:  # a server is refused the same
        render_serve(_recipe(*overrides), ServeSettings())
    assert served.value.problems == [line]


def test_the_cli_flags_are_the_recipe_keys(cli):
    refused = cli("k8s", "render", RECIPE, "--profile", "gaudi", "--devices", "dra", "--kubernetes-version", "1.30")
    assert refused.code == 2
    assert refused.err.strip().splitlines() == [
        (
            "kubetune: error: k8s.devices=dra on k8s.kubernetes_version=1.30: DRA (resource.k8s.io/v1) needs "
            "Kubernetes 1.34 or newer, this cluster is 1.30; use k8s.devices=plugin (the device plugin) or upgrade "
            "the cluster"
        )
    ]
    rendered = cli(
        "k8s", "render-serve", RECIPE, "--profile", "nvidia", "--devices", "dra", "--kubernetes-version", "1.34"
    )
    assert rendered.code == 0 and "kind: ResourceClaimTemplate" in rendered.out
    bad = cli("k8s", "render", RECIPE, "--profile", "gaudi", "--devices", "claims")
    assert bad.code == 2 and "k8s.devices" in bad.err


def test_the_operator_renders_and_owns_the_claim_template():
    from kubetune.operator import plan

    spec = plan.FineTuneSpec(profile="gaudi")
    recipe = plan.load_recipe_for("ft", "team", {"k8s": {"devices": "dra", "dra": {"model": "gaudi3"}}}, spec)
    owner = {"metadata": {"name": "ft", "uid": "uid-ft"}}
    template = _template(plan.owned(render(recipe).objects, owner, delete_claim=False))
    assert template["metadata"]["name"] == "ft-cards"
    assert template["metadata"]["ownerReferences"][0]["uid"] == "uid-ft"  # deleted with the FineTune
    with pytest.raises(UserError, match=r"k8s\.devices=dra on k8s\.kubernetes_version=1\.32"):
        plan.load_recipe_for("ft", "team", {"k8s": {"devices": "dra", "kubernetes_version": "1.32"}}, spec)


def test_submit_creates_the_template_before_the_job_and_delete_removes_it(cli, kube):
    args = ("k8s", "submit", RECIPE, "--profile", "gaudi", "--devices", "dra", "k8s.dra.model=gaudi2")
    first = cli(*args)
    assert first.code == 0, first.err
    lines = first.out.splitlines()
    created = [i for i, line in enumerate(lines) if line.startswith("created ResourceClaimTemplate")]
    job = [i for i, line in enumerate(lines) if line.startswith("created PyTorchJob")]
    assert created and job and created[0] < job[0], first.out
    templates = kube.objects("resource.k8s.io/v1/resourceclaimtemplates")
    assert list(templates) == [("kubetune", f"{RECIPE}-cards")]
    # the claim cannot change in place (a template's spec is immutable): kept, not patched
    changed = cli(*args[:-1], "k8s.dra.model=gaudi3")
    assert changed.code == 0 and f"kept ResourceClaimTemplate kubetune/{RECIPE}-cards" in changed.out
    gone = cli("k8s", "delete", RECIPE)
    assert gone.code == 0 and kube.objects("resource.k8s.io/v1/resourceclaimtemplates") == {}, gone.out
