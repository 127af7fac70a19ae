"""TrainJob on Trainer v2's newest API (v2.3.0, the vendored CRDs): what the CRD's CEL rules
add to its schema, and the trainerStatus progress push against the same CRD's status."""

from __future__ import annotations

import copy
import importlib.metadata

import pytest

from kubetune.k8s import render as r
from kubetune.k8s.validate import validate_objects, vendored_crd_dir
from kubetune.recipe.loader import load_recipe
from kubetune.training.kubeflow_progress import status_body

SEED = "llama2-7b-medical-flashcards"


def trainjob_objects(*overrides):
    loaded = load_recipe(SEED, ["k8s.api=trainjob", *overrides])
    return r.render(loaded.recipe, with_runtime=True).objects


@pytest.fixture(scope="module")
def trainjob():
    return trainjob_objects()[-1]


def test_the_trainer_sdk_and_the_vendored_crds_are_one_release():
    version = importlib.metadata.version("kubeflow-trainer-api")
    readme = (vendored_crd_dir() / "README.md").read_text()
    assert version.startswith("2.3."), f"kubeflow-trainer-api {version}: vendor that release's CRDs and bump the row"
    assert "| `trainer.kubeflow.org_trainjobs.yaml` | TrainJob, `trainer.kubeflow.org`, `v1alpha1` |" in readme
    assert "`v2.3.0`" in readme


def test_a_trainjob_name_must_be_an_rfc1035_label(trainjob):
    """The TrainJob CRD's CEL rule: a name starting with a digit is valid for a PyTorchJob, not here."""
    objects = trainjob_objects("k8s.name=7b-run")
    assert validate_objects(objects) == ["TrainJob/7b-run: (root): metadata.name must match RFC 1035 DNS label format"]
    assert validate_objects(trainjob_objects()) == []


def _with_status(job, status):
    job = copy.deepcopy(job)
    job["status"] = status
    return [job]


def test_the_progress_push_is_a_status_the_trainjob_crd_accepts(trainjob, crd_dir):
    body = status_body(42.7, 90.0, {"loss": 1.2345, "tokens_per_s": 850.2, "step": 12})
    assert validate_objects(_with_status(trainjob, body), crd_dir=crd_dir) == []
    assert body["trainerStatus"]["progressPercentage"] == 42


@pytest.mark.parametrize(
    "change,problem",
    [
        (lambda s: s.pop("lastUpdatedTime"), "lastUpdatedTime is required when trainerStatus is present"),
        (lambda s: s.update(progressPercentage=101), "101 is greater than the maximum of 100"),
        (lambda s: s["metrics"].append({"name": "loss", "value": 1.5}), "1.5 is not of type 'string'"),
    ],
)
def test_a_status_the_crd_refuses_is_caught(trainjob, change, problem):
    body = status_body(10, None, {"loss": 2.0})
    change(body["trainerStatus"])
    (found,) = validate_objects(_with_status(trainjob, body))
    assert found.startswith("TrainJob/llama2-7b-medical-flashcards: status/trainerStatus") and problem in found
