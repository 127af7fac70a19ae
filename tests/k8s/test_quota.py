"""Quotas are per namespace: a team's budget shared by its jobs, and a job that does not fit in
what the others leave is refused by `submit` and explained by `doctor`.

Two jobs in one namespace run against kmock (real client, real HTTP, see conftest.py); kmock
has no operator, so each job's training pods are created here from its own pod template, as
the training operator would create them.
"""

from __future__ import annotations

from decimal import Decimal

import pytest

from kubetune.contracts.kube import INSTANCE, MANAGED_BY
from kubetune.errors import RecipeError
from kubetune.k8s import quota
from kubetune.k8s import render as r
from kubetune.k8s.names import NAMESPACE_QUOTA
from kubetune.k8s.validate import validate_objects
from kubetune.recipe.loader import load_recipe

RECIPE = "smollm2-135m-lora-cpu"  # 2 workers of 8 CPUs / 32Gi, plus a data pod of 250m / 256Mi
NS = "kubetune"
BUDGET = ["k8s.namespace_quota.cpu=40", "k8s.namespace_quota.memory=160Gi", "k8s.namespace_quota.pods=6"]


def rendered(*overrides):
    return r.render(load_recipe(RECIPE, list(overrides)).recipe)


def quotas(objects):
    return [o for o in objects if o["kind"] == "ResourceQuota"]


# ---------------------------------------------------------------------------------- render


def test_namespace_quota_is_one_object_per_namespace_whatever_the_job():
    a, b = rendered("k8s.name=job-a", *BUDGET), rendered("k8s.name=job-b", *BUDGET)
    (qa,), (qb,) = quotas(a.objects), quotas(b.objects)
    assert qa == qb  # the same object: submitting the second job changes nothing
    assert qa["metadata"]["name"] == NAMESPACE_QUOTA and INSTANCE not in qa["metadata"]["labels"]
    assert qa["metadata"]["labels"][MANAGED_BY] == "kubetune"
    assert qa["spec"]["hard"] == {
        "requests.cpu": "40",
        "limits.cpu": "40",
        "requests.memory": "160Gi",
        "limits.memory": "160Gi",
        "pods": "6",
    }
    assert validate_objects(a.objects) == []


def test_namespace_quota_caps_the_profiles_accelerator():
    objects = rendered("k8s.profile=gaudi", "k8s.namespace_quota.accelerators=32", "k8s.namespace_quota.pods=9").objects
    assert quotas(objects)[0]["spec"]["hard"] == {"requests.habana.ai/gaudi": "32", "pods": "9"}
    cpu = rendered("k8s.namespace_quota.accelerators=4", "k8s.namespace_quota.pods=9")
    assert "habana" not in str(quotas(cpu.objects)) and "nvidia" not in str(quotas(cpu.objects))
    assert any("k8s.namespace_quota.accelerators is not rendered on the cpu profile" in w for w in cpu.warnings)


def test_a_per_job_quota_warns_that_it_caps_the_whole_namespace():
    result = rendered("k8s.quota=true")
    assert any(
        "k8s.quota=true sizes ResourceQuota smollm2-135m-lora-cpu-quota to this job alone" in w
        and "k8s.namespace_quota" in w
        for w in result.warnings
    )
    with pytest.raises(RecipeError, match=r"keep k8s\.namespace_quota and set k8s\.quota=false"):
        rendered("k8s.quota=true", *BUDGET)


def test_render_refuses_the_seed_job_under_a_smaller_namespace_quota_as_submit_would(cli):
    # the case: 4 pods of 200 CPUs under a rendered 600-CPU budget could never start
    result = cli("k8s", "render", "llama2-7b-medical-flashcards", "k8s.namespace_quota.cpu=600")
    assert result.code == 2 and result.out == ""
    assert result.err.count("\n") == 1, result.err
    assert (
        "k8s.namespace_quota.cpu=600 is less than what this job requests, 800.25 cpu (4 training pods of 200 and "
        "the data-access pod): it could never start; raise k8s.namespace_quota.cpu to at least 800.25, or lower "
        "k8s.replicas or k8s.profile_resources.cpu.cpu"
    ) in result.err
    assert cli("k8s", "render", "llama2-7b-medical-flashcards", "k8s.namespace_quota.cpu=801").code == 0


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["k8s.namespace_quota.pods=2"], "k8s.namespace_quota.pods=2 is less than what this job requests, 3 pods"),
        (
            ["k8s.namespace_quota.memory=64Gi"],
            (
                "k8s.namespace_quota.memory=64Gi is less than what this job requests, 64.25Gi memory (2 training pods "
                "of 32Gi and the data-access pod)"
            ),
        ),
        (
            ["k8s.profile=gaudi", "k8s.replicas=2", "k8s.namespace_quota.accelerators=8"],
            (
                "k8s.namespace_quota.accelerators=8 is less than what this job requests, 16 habana.ai/gaudi "
                "(2 training pods of 8 and the data-access pod): it could never start; raise "
                "k8s.namespace_quota.accelerators to at least 16, or lower k8s.replicas or k8s.resources.accelerators"
            ),
        ),
        # an elastic job may grow to max_replicas: that is what the budget must hold
        (
            ["k8s.elastic.enabled=true", "k8s.elastic.max_replicas=5", "k8s.namespace_quota.cpu=40"],
            "k8s.namespace_quota.cpu=40 is less than what this job requests, 40.25 cpu (5 training pods of 8",
        ),
    ],
)
def test_render_refuses_each_resource_the_namespace_quota_cannot_hold(overrides, line):
    with pytest.raises(RecipeError) as refused:
        rendered(*overrides)
    assert line in str(refused.value)
    assert "raise k8s.namespace_quota." in str(refused.value)


def test_a_job_that_fits_its_budget_exactly_renders():
    # 2 x 8 CPUs + 0.25 for the data pod, 2 x 32Gi + 256Mi, 3 pods: nothing to spare, nothing short
    objects = rendered(
        "k8s.namespace_quota.cpu=16.25", "k8s.namespace_quota.memory=64.25Gi", "k8s.namespace_quota.pods=3"
    ).objects
    assert quotas(objects)[0]["spec"]["hard"]["requests.cpu"] == "16.25"


# ------------------------------------------------------------------------ what a quota counts


def _pod(cpu, memory, phase="Running", job=None, init=None):
    spec = {"containers": [{"resources": {"limits": {"cpu": cpu, "memory": memory}}}]}
    if init:
        spec["initContainers"] = [{"resources": {"requests": {"cpu": init}}}]
    labels = {INSTANCE: job} if job else {}
    return {"metadata": {"name": f"p-{cpu}", "labels": labels}, "spec": spec, "status": {"phase": phase}}


def test_usage_counts_requests_defaulted_from_limits_init_containers_and_unfinished_pods_only():
    held = quota.usage_by_owner(
        [_pod("2", "1Gi", job="a"), _pod("1", "1Gi", job="a", init="4"), _pod("8", "8Gi", phase="Succeeded", job="b")]
    )
    assert set(held) == {"a"}  # a finished pod holds nothing
    assert held["a"]["requests.cpu"] == Decimal(6) and held["a"]["limits.cpu"] == Decimal(3)
    assert held["a"]["requests.memory"] == 2 * 2**30 and held["a"]["pods"] == 2


def test_job_usage_takes_an_elastic_jobs_most_replicas_and_a_trainjobs_nodes():
    elastic = rendered("k8s.elastic.enabled=true", "k8s.elastic.max_replicas=5").job
    assert quota.job_usage(elastic)["pods"] == 5 and quota.job_usage(elastic)["requests.cpu"] == 40
    trainjob = rendered("k8s.api=trainjob", "k8s.replicas=3").job
    assert quota.job_usage(trainjob)["pods"] == 3 and quota.job_usage(trainjob)["limits.memory"] == 96 * 2**30


def test_scoped_quotas_are_left_to_the_api_server():
    scoped = {"metadata": {"name": "hi"}, "spec": {"hard": {"pods": "0"}, "scopes": ["BestEffort"]}}
    assert quota.shortfalls([scoped], [], {"pods": Decimal(3)}, "job", ours=False) == []


# ------------------------------------------------------------------- two jobs against kmock


def start_pods(kube, job):
    """What the training operator does: one pod per replica, from the job's pod template."""
    pytorchjob = kube.objects("kubeflow.org/v1/pytorchjobs")[(NS, job)]
    client = kube.client()
    for role, spec in pytorchjob["spec"]["pytorchReplicaSpecs"].items():
        for i in range(spec["replicas"]):
            template = spec["template"]
            client.create(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": f"{job}-{role.lower()}-{i}",
                        "namespace": NS,
                        "labels": {**template["metadata"]["labels"], "training.kubeflow.org/replica-type": role},
                    },
                    "spec": template["spec"],
                    "status": {"phase": "Running"},
                }
            )


def submit(cli, job, *overrides):
    return cli("k8s", "submit", RECIPE, f"k8s.name={job}", *overrides)


def test_two_per_job_quotas_do_not_fit_side_by_side_and_submit_says_so(cli, kube):
    # the problem a per-job quota makes: job-a's quota, sized to job-a, caps job-b's pods too
    first = submit(cli, "job-a", "k8s.quota=true")
    assert first.code == 0, first.err
    start_pods(kube, "job-a")
    second = submit(cli, "job-b", "k8s.quota=true")
    assert second.code == 2
    assert "job-b does not fit in ResourceQuota kubetune/job-a-quota: requests.cpu needs 16.25, 0 of 16.25 remain" in (
        second.err
    )
    assert "(held by job-a: requests.cpu 16.25" in second.err and "nothing was submitted" in second.err
    assert (NS, "job-b-recipe") not in kube.objects("v1/configmaps")  # refused before anything was created


def test_a_namespace_budget_holds_two_jobs_and_refuses_a_third(cli, kube):
    a = submit(cli, "job-a", *BUDGET)
    assert a.code == 0, a.err
    assert f"created ResourceQuota {NS}/{NAMESPACE_QUOTA}" in a.out
    start_pods(kube, "job-a")
    b = submit(cli, "job-b", *BUDGET)
    assert b.code == 0, b.err
    assert f"unchanged ResourceQuota {NS}/{NAMESPACE_QUOTA}" in b.out  # one budget, shared
    start_pods(kube, "job-b")
    assert [name for _, name in kube.objects("v1/resourcequotas")] == [NAMESPACE_QUOTA]

    again = submit(cli, "job-a", *BUDGET)  # its own pods are not counted twice
    assert again.code == 0, again.err

    c = submit(cli, "job-c", *BUDGET)
    assert c.code == 2
    assert (
        f"job-c does not fit in ResourceQuota {NS}/{NAMESPACE_QUOTA}: requests.cpu needs 16.25, 7.5 of 40 remain; "
        "requests.memory needs 64.25Gi, 31.5Gi of 160Gi remain; pods needs 3, 0 of 6 remain "
        "(held by job-a: requests.cpu 16.25, requests.memory 64.25Gi, pods 3; "
        "job-b: requests.cpu 16.25, requests.memory 64.25Gi, pods 3)"
    ) in c.err


def test_a_different_budget_in_a_recipe_does_not_change_the_namespaces(cli, kube):
    assert submit(cli, "job-a", *BUDGET).code == 0
    bigger = submit(cli, "job-b", "k8s.namespace_quota.cpu=400", "k8s.namespace_quota.pods=60")
    assert bigger.code == 0, bigger.err
    assert f"kept ResourceQuota {NS}/{NAMESPACE_QUOTA} (the namespace's budget stays as it is" in bigger.out
    live = kube.objects("v1/resourcequotas")[(NS, NAMESPACE_QUOTA)]
    assert live["spec"]["hard"]["requests.cpu"] == "40"


def test_doctor_says_a_submitted_job_no_longer_fits(cli, kube):
    assert submit(cli, "job-a", *BUDGET).code == 0
    assert submit(cli, "job-b", *BUDGET).code == 0
    start_pods(kube, "job-a")  # job-b's pods are not created: the budget shrank meanwhile
    kube.client().patch(
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": NAMESPACE_QUOTA, "namespace": NS},
            "spec": {"hard": {"requests.cpu": "20"}},
        }
    )
    result = cli("k8s", "doctor", "job-b")
    assert result.code == 1, result.out + result.err
    assert (
        f"[error] PyTorchJob job-b: job-b does not fit in ResourceQuota {NS}/{NAMESPACE_QUOTA}: "
        "requests.cpu needs 16, 3.5 of 20 remain (held by job-a: requests.cpu 16.25; this job: requests.cpu 0.25)"
    ) in result.out
    assert "raise the quota" in result.out
    healthy = cli("k8s", "doctor", "job-a")
    assert "does not fit" not in healthy.out  # job-a has every pod it needs
