"""k8s.devices=dra: the ResourceClaimTemplate a job's or a server's pods claim their cards from.

One template per pod template (every pod gets its own claim from it, which the control plane
deletes with the pod): one request of `count` cards of the vendor's DeviceClass, narrowed by
CEL selectors from `k8s.dra` (model, least memory) and, for more than one card, a
`matchAttribute` constraint that puts them all on one PCIe root, NUMA node or board. The
DeviceClass (the DRA driver's, `kubetune k8s render-components --devices dra`) already keeps
unhealthy cards out. Attribute names come from `kubetune.contracts.dra`, which the driver publishes.

The pods name the claim in `spec.resourceClaims` and their container in `resources.claims`
(`profiles.worker_resources`), and carry no habana.ai/gaudi / nvidia.com/gpu limits.
"""

from __future__ import annotations

import json

from kubetune.contracts import dra
from kubetune.contracts.kube import KubeObject, parse_quantity
from kubetune.k8s import profiles
from kubetune.k8s.names import Names, standard_labels
from kubetune.recipe.k8s import K8sSection


def _attribute(vendor: dra.DraVendor, group: str, name: str) -> str:
    """`device.attributes["<domain>"].<name>`; a qualified name reads its own domain."""
    domain, _, short = dra.qualified(vendor, name).rpartition("/")
    return f'device.{group}["{domain}"].{short}'


def _memory_text(k8s: K8sSection) -> str:
    value = k8s.dra.min_memory
    return value if isinstance(value, str) else str(int(parse_quantity(value or 0)))


def selectors(k8s: K8sSection) -> list[str]:
    """The CEL expressions every claimed card must pass. Each one first asks whether the device
    has the attribute (`has`): a missing attribute is an allocation error in Kubernetes' CEL,
    where it should only mean "not this card"."""
    vendor = dra.vendor_for(k8s.profile)
    out = []
    if k8s.dra.model is not None:
        model = _attribute(vendor, "attributes", dra.ATTR_MODEL)
        out.append(f"has({model}) && {model} == {json.dumps(k8s.dra.model)}")
    if k8s.dra.min_memory is not None:
        memory = _attribute(vendor, "capacity", dra.CAPACITY_MEMORY)
        out.append(f"has({memory}) && {memory}.compareTo(quantity({json.dumps(_memory_text(k8s))})) >= 0")
    return out


def constraints(k8s: K8sSection, cards: int) -> list[KubeObject]:
    """All cards of the claim on one PCIe root / NUMA node / board, where asked (one card: none)."""
    align = profiles.dra_align(k8s)
    if align == "none" or cards < 2:
        return []
    attribute = dra.qualified(dra.vendor_for(k8s.profile), dra.ALIGN_ATTRIBUTES[align])
    return [{"requests": [profiles.CLAIM], "matchAttribute": attribute}]


def claim_template(k8s: K8sSection, names: Names, component: str) -> KubeObject:
    """The pods' ResourceClaimTemplate (resource.k8s.io/v1), named `names.claim_template`."""
    vendor = dra.vendor_for(k8s.profile)
    cards = int(k8s.worker_resources()["accelerators"])
    exactly: KubeObject = {"deviceClassName": vendor.device_class, "allocationMode": "ExactCount", "count": cards}
    if found := selectors(k8s):
        exactly["selectors"] = [{"cel": {"expression": expression}} for expression in found]
    devices: KubeObject = {"requests": [{"name": profiles.CLAIM, "exactly": exactly}]}
    if pinned := constraints(k8s, cards):
        devices["constraints"] = pinned
    labels = standard_labels(names, component)
    return {
        "apiVersion": dra.RESOURCE_API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": names.claim_template, "namespace": names.namespace, "labels": labels},
        "spec": {"metadata": {"labels": labels}, "spec": {"devices": devices}},
    }


def device_warnings(k8s: K8sSection) -> list[str]:
    """k8s.dra keys set where nothing reads them (the device plugin counts cards, it cannot pick
    them); with claims, a namespace quota on the extended resource that no claim pod requests."""
    if k8s.devices == "dra":
        if k8s.namespace_quota.accelerators is None:
            return []
        resource = dra.vendor_for(k8s.profile).extended_resource
        line = (
            f"k8s.namespace_quota.accelerators caps requests of {resource}, which pods that claim their cards "
            "(k8s.devices=dra) do not make: the namespace quota counts none of this job's cards"
        )
        return [line]
    given = [name for name, value in k8s.dra if value is not None]  # every k8s.dra key defaults to null
    if not given:
        return []
    keys = ", ".join(f"k8s.dra.{name}" for name in given)
    return [f"{keys}: only claims read it, and k8s.devices=plugin requests whole cards; set k8s.devices=dra"]


def pod_claims(k8s: K8sSection, names: Names) -> list[KubeObject] | None:
    """The pod's `spec.resourceClaims` (None on the device-plugin path)."""
    if k8s.devices != "dra":
        return None
    return [{"name": profiles.CLAIM, "resourceClaimTemplateName": names.claim_template}]
