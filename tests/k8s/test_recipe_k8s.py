"""The `k8s` recipe section: quantities, profile defaults, impossible resources."""

from __future__ import annotations

from decimal import Decimal

import pytest
from pydantic import BaseModel

from kubetune.contracts.kube import parse_quantity
from kubetune.errors import RecipeError
from kubetune.recipe import k8s as section
from kubetune.recipe.loader import load_recipe


def k8s(*overrides):
    return load_recipe("smollm2-135m-lora-cpu", list(overrides)).recipe.k8s


@pytest.mark.parametrize(
    "text,value",
    [
        ("8", 8),
        ("500m", Decimal("0.5")),
        ("32Gi", 32 * 2**30),
        ("1.5G", 1_500_000_000),
        ("1e3", 1000),
        (2, 2),
        ("95000Mi", 95000 * 2**20),
    ],
)
def test_parse_quantity(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "8 cores", "Gi", "1.2.3", "32GB"])
def test_parse_quantity_rejects(text):
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)


def test_profile_defaults_fill_only_null_fields():
    assert k8s().worker_resources() == section.PROFILE_DEFAULTS["cpu"]
    gaudi = k8s("k8s.profile=gaudi", "k8s.resources.memory=300Gi")
    assert gaudi.worker_resources()["memory"] == "300Gi" and gaudi.worker_resources()["accelerators"] == 8
    assert gaudi.processes_per_pod() == 8
    assert k8s().processes_per_pod() == 1
    assert k8s("k8s.nproc_per_node=4", "k8s.resources.cpu=8").processes_per_pod() == 4


@pytest.mark.parametrize(
    "overrides,problem",
    [
        (["k8s.resources.cpu=0"], "k8s.resources.cpu must be more than 0 (got 0)"),
        (["k8s.resources.memory=0"], "k8s.resources.memory must be more than 0"),
        (["k8s.resources.shm_size=32Gi"], "k8s.resources.shm_size 32Gi must be smaller than k8s.resources.memory 32Gi"),
        (["k8s.resources.accelerators=1"], "k8s.resources.accelerators=1 on the cpu profile"),
        (
            ["k8s.profile=nvidia", "k8s.resources.accelerators=0"],
            "the nvidia profile needs k8s.resources.accelerators >= 1",
        ),
        (["k8s.profile=gaudi", "k8s.resources.hugepages_2mi=3Mi"], "not a multiple of 2Mi"),
        (["k8s.profile=gaudi", "k8s.nproc_per_node=9"], "exceeds the 8 accelerators per pod"),
        (
            ["k8s.elastic.enabled=true", "k8s.elastic.max_replicas=4", "k8s.api=trainjob"],
            "min_replicas..max_replicas (2..4) is a PyTorchJob feature",
        ),
        (["k8s.priority_value=10"], "k8s.priority_value needs k8s.priority_class"),
        # a value from profile_resources is named by its own key
        (["k8s.profile_resources.cpu.cpu=0"], "k8s.profile_resources.cpu.cpu must be more than 0"),
        (["k8s.profile_resources.cpu.accelerators=2"], "k8s.profile_resources.cpu.accelerators=2 on the cpu"),
    ],
)
def test_impossible_resources(overrides, problem):
    problems = section.resource_problems(k8s(*overrides))
    assert len(problems) == 1 and problem in problems[0]


def test_possible_resources_have_no_problems():
    for profile in ("cpu", "gaudi", "nvidia"):
        assert section.resource_problems(k8s(f"k8s.profile={profile}")) == []
    assert section.resource_problems(k8s("k8s.resources.cpu=200", "k8s.resources.memory=226Gi", "k8s.replicas=4")) == []
    # Workers only, a fixed number of them: what a TrainJob's nodes are anyway (seed 002's recipe renders both)
    assert section.resource_problems(k8s("k8s.elastic.enabled=true", "k8s.replicas=4", "k8s.api=trainjob")) == []


def test_profile_resources_fill_what_resources_leave_null_for_that_profile_only():
    overrides = ["k8s.profile_resources.gaudi.accelerators=4", "k8s.profile_resources.gaudi.cpu=32"]
    gaudi = k8s("k8s.profile=gaudi", *overrides).worker_resources()
    assert (gaudi["accelerators"], gaudi["cpu"], gaudi["memory"]) == (4, 32, "400Gi")  # memory: the default
    assert k8s("k8s.profile=cpu", *overrides).worker_resources() == section.PROFILE_DEFAULTS["cpu"]
    # k8s.resources wins on every profile, so a command-line override always takes effect
    assert k8s("k8s.profile=gaudi", *overrides, "k8s.resources.cpu=48").worker_resources()["cpu"] == 48


@pytest.mark.parametrize(
    "override,message",
    [
        ("k8s.namespace=Team_A", "not a DNS-1123 label"),
        ("k8s.resources.memory=lots", "not a Kubernetes quantity"),
        ("k8s.profile=tpu", "expected 'cpu', 'gaudi' or 'nvidia'"),
        ("k8s.gang=slurm", "expected 'none', 'coscheduling' or 'volcano'"),
        ("k8s.storage.access_mode=ReadOnlyMany", "expected 'ReadWriteMany' or 'ReadWriteOnce'"),
    ],
)
def test_bad_values(override, message):
    with pytest.raises(RecipeError) as err:
        k8s(override)
    assert len(err.value.problems) == 1 and message in err.value.problems[0]


def _models(model: type[BaseModel]):
    yield model
    for info in model.model_fields.values():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _models(ann)


def test_every_key_is_documented():
    for model in _models(section.K8sSection):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name}"
    for name, info in section.Toleration.model_fields.items():
        assert info.description, f"Toleration.{name}"
