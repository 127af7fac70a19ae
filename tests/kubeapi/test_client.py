"""`KubeClient`'s calls as the cluster components make them, against kmock's API server: the
patch content types the API server tells apart, and field selectors checked on this side too."""

from __future__ import annotations

import pytest

kmock = pytest.importorskip("kmock")

from tests.kit.kube import KmockServer  # noqa: E402

SLICE = ("resource.k8s.io/v1", "ResourceSlice")


@pytest.fixture
def server():
    s = KmockServer(("resource.k8s.io/v1/resourceslices",))
    yield s
    s.stop()


def _slice(node: str, driver: str, **spec) -> dict:
    spec = {"nodeName": node, "driver": driver, **spec}
    return {"apiVersion": SLICE[0], "kind": SLICE[1], "metadata": {"name": f"{node}-{driver}"}, "spec": spec}


def test_list_keeps_only_what_the_field_selector_asks_for_even_where_the_server_ignores_it(server):
    kube = server.client()
    for node, driver in (("n1", "a"), ("n1", "b"), ("n2", "a")):
        kube.create(_slice(node, driver))
    found = kube.list(*SLICE, fields={"spec.nodeName": "n1", "spec.driver": "a"})
    assert [s["metadata"]["name"] for s in found] == ["n1-a"]
    (request,) = server.emulator[kmock.action.LIST]
    assert request.params["fieldSelector"] == "spec.nodeName=n1,spec.driver=a"


def test_json_patch_replaces_a_whole_field_where_a_merge_patch_keeps_keys(server):
    kube = server.client()
    kube.create(_slice("n1", "a", devices=[{"name": "card-0"}], pool={"name": "n1", "generation": 1}))
    kube.patch({"apiVersion": SLICE[0], "kind": SLICE[1], "metadata": {"name": "n1-a"}, "spec": {"pool": None}})
    assert "pool" not in kube.get(*SLICE, "n1-a")["spec"]  # a None removes the key in a merge patch
    kube.json_patch(*SLICE, "n1-a", [{"op": "replace", "path": "/spec", "value": {"nodeName": "n1", "driver": "a"}}])
    assert kube.get(*SLICE, "n1-a")["spec"] == {"nodeName": "n1", "driver": "a"}  # devices gone too
    merge, json_patch = (r.headers["Content-Type"] for r in server.emulator[kmock.action.UPDATE])
    assert (merge, json_patch) == ("application/merge-patch+json", "application/json-patch+json")
