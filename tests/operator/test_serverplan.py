"""The operator's decisions about shared servers (`kubetune.operator.serverplan`, and the
FineTune phases of `plan.next_step` for spec.serve.server), pure."""

from __future__ import annotations

import dataclasses

import pytest

from kubetune.errors import RecipeError
from kubetune.k8s.modelserver import ModelServerSpec
from kubetune.operator import plan, serverplan

from .test_plan import BASE, recipe

SERVER = ModelServerSpec(base="HuggingFaceTB/SmolLM2-135M-Instruct")
TRAINED = dataclasses.replace(BASE, trained=True, export_wanted=False, serve_enabled=False, adapter_server="shared")


@pytest.mark.parametrize(
    ("changes", "phase", "actions"),
    [
        ({"server_found": False}, "Exporting", ()),  # waits for the ModelServer
        ({"base_mismatch": "another base"}, "Failed", ()),
        ({}, "Exporting", ("create-adapter-export",)),
        ({"adapter_export_state": "Running"}, "Exporting", ()),
        ({"adapter_export_state": "Failed"}, "Failed", ()),
        ({"adapter_export_state": "Complete"}, "Serving", ("register-adapter",)),
        # the adapter-export Job checked the eval gate: a failure is trained and saved, not served
        ({"adapter_export_state": "Complete", "gate": {"passed": False}}, "Succeeded", ()),
        ({"adapter_export_state": "Complete", "gate": {"passed": True}}, "Serving", ("register-adapter",)),
    ],
)
def test_a_trained_finetune_of_a_server_exports_its_adapter_then_serves(changes, phase, actions):
    assert plan.next_step(dataclasses.replace(TRAINED, **changes)) == plan.Step(phase, actions)


def test_a_server_takes_the_adapter_not_a_merged_model_and_only_a_lora_run():
    spec = plan.FineTuneSpec(serve=plan.ServeSpec(True, server="shared"))
    assert not spec.export_wanted(recipe())
    with pytest.raises(RecipeError, match=r"a ModelServer serves LoRA adapters, and finetune\.method is full"):
        recipe({"finetune": {"method": "full"}}, serve=plan.ServeSpec(server="shared"))


def test_another_base_names_both():
    run = recipe({"model": {"name_or_path": "org/other", "revision": "v2"}})
    assert serverplan.base_mismatch(run, "shared", SERVER) == (
        "the adapter was trained on org/other@v2 but ModelServer shared serves "
        "HuggingFaceTB/SmolLM2-135M-Instruct@default: an adapter only fits the base it was trained on; "
        "serve it on a ModelServer of that base"
    )
    same = recipe({"model": {"name_or_path": SERVER.base}})
    assert serverplan.base_mismatch(same, "shared", SERVER) is None


def _ft(name: str, adapter: dict | None, deleting: bool = False) -> dict:
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {"adapter": adapter} if adapter else {}}


def _adapter(name: str, version: str, registered: bool = True, server: str = "shared") -> dict:
    ref = serverplan.AdapterRef(server, name, version, f"/adapters/{name}/{version}", registered)
    return ref.status()


def test_the_registry_is_what_registered_finetunes_of_this_server_hold():
    finetunes = [
        _ft("a", _adapter("cardio", "v1")),
        _ft("b", _adapter("cardio", "v2", registered=False)),  # exporting still
        _ft("c", _adapter("radio", "v1"), deleting=True),  # going: unloaded
        _ft("d", _adapter("derm", "v1", server="other")),
        _ft("e", None),
    ]
    registry = serverplan.registry_of("shared", finetunes)
    assert registry == {
        "cardio@v1": {"name": "cardio", "version": "v1", "servedName": "cardio@v1", "path": "/adapters/cardio/v1",
                      "finetune": "a"},
    }  # fmt: skip
    taken = serverplan.taken_versions("cardio", "shared", finetunes, [{"name": "cardio", "version": "v4"}])
    assert serverplan.new_adapter("shared", "cardio", taken, SERVER).version == "v5"
    assert serverplan.new_adapter("shared", "new", [], SERVER).path == "/adapters/new/v1"


def test_a_replica_loads_what_is_missing_and_unloads_only_stale_versions():
    wanted = {"cardio@v1": "/adapters/cardio/v1", "radio@v2": "/adapters/radio/v2"}
    loaded = {"cardio@v1", "old@v3", "cardio", "declared"}  # an alias and a declared adapter stay
    assert serverplan.replica_changes(wanted, loaded) == ([("radio@v2", "/adapters/radio/v2")], ["old@v3"])


def test_a_failed_load_backs_off_doubling_up_to_the_cap():
    first = serverplan.failed_again(None, "HTTP 400: bad files", now=100.0, base_s=5.0)
    second = serverplan.failed_again(first, "HTTP 400: bad files", now=105.0, base_s=5.0)
    assert (first.attempts, first.next_try, second.attempts, second.next_try) == (1, 105.0, 2, 115.0)
    many = serverplan.LoadFailure(20, 0.0, "")
    assert serverplan.failed_again(many, "x", now=0.0, base_s=5.0).next_try == serverplan.RETRY_CAP_S


def test_the_condition_names_each_replica_and_why():
    pods = [
        {"pod": "s-0", "loaded": ["cardio@v1"], "failed": []},
        {"pod": "s-1", "loaded": [], "failed": [{"adapter": "cardio@v1", "reason": "HTTP 400: out of memory"}]},
        {"pod": "s-2", "loaded": [], "failed": []},
    ]
    assert serverplan.loaded_condition_text("shared", "cardio@v1", pods) == (
        False,
        "LoadFailed",
        "s-0: loaded\ns-1: load failed: HTTP 400: out of memory (retrying)\ns-2: loading",
    )
    assert serverplan.loaded_condition_text("shared", "cardio@v1", pods[:1]) == (True, "Loaded", "s-0: loaded")
    assert serverplan.loaded_condition_text("shared", "x", [])[1] == "NoReadyReplica"


def test_the_alias_routes_by_the_servers_weights_else_to_the_newest_version():
    registry = serverplan.registry_of(
        "shared",
        [_ft("a", _adapter("cardio", "v1")), _ft("b", _adapter("cardio", "v2")), _ft("c", _adapter("radio", "v3"))],
    )
    assert serverplan.alias_weights(registry, {}) == {"cardio": {"cardio@v2": 100}, "radio": {"radio@v3": 100}}
    split = serverplan.alias_weights(registry, {"cardio": {"v1": 90, "v2": 10}, "radio": {"v9": 100}})
    assert split == {"cardio": {"cardio@v1": 90, "cardio@v2": 10}, "radio": {"radio@v3": 100}}  # v9: not registered


def test_a_version_is_claimed_once_through_the_api_servers_409(cluster):
    """Two FineTunes that finish together both see no version taken: the claim's create decides."""
    from kubetune.operator import actions

    server = {"apiVersion": "kubetune.io/v1alpha1", "kind": "ModelServer",
              "metadata": {"name": "shared", "namespace": "kubetune", "uid": "uid-shared"},
              "spec": {"base": {"model": SERVER.base}}}  # fmt: skip
    first = actions.claim_version(cluster.client, server, "cardio-a", "cardio", [])
    second = actions.claim_version(cluster.client, server, "cardio-b", "cardio", [])
    again = actions.claim_version(cluster.client, server, "cardio-a", "cardio", [])  # a retry finds its own
    assert (first.version, second.version, again.version) == ("v1", "v2", "v1")
    claim = cluster.get("v1", "ConfigMap", "shared-adapter-cardio-v2")
    assert claim["data"]["finetune"] == "cardio-b"
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "ModelServer"  # outlives the FineTune
