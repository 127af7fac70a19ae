"""Kueue: the queued job (suspended, topology annotations), `render --kueue`'s queue objects,
their validation (Kueue's CRD schemas and CEL rules), and `doctor` on real Workload objects."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from kubetune.contracts.kube import parse_quantity
from kubetune.errors import RecipeError
from kubetune.k8s import kueue
from kubetune.k8s import render as r
from kubetune.k8s.doctor import Snapshot, diagnose
from kubetune.k8s.validate import validate_objects
from kubetune.recipe.loader import load_recipe

SEED = "llama2-7b-medical-flashcards"
RACK = "example.com/rack"
LEVELS = f"k8s.kueue.topology.levels=[{RACK}, kubernetes.io/hostname]"
QUEUE = "k8s.queue=team-a"


def rendered(profile="cpu", api="pytorchjob", *overrides, with_kueue=False):
    # the seed's job is elastic (Workers only): a fixed one has both pod sets, Master and Worker
    fixed = ["k8s.elastic.enabled=false"]
    loaded = load_recipe(SEED, [f"k8s.profile={profile}", f"k8s.api={api}", *fixed, *overrides])
    return r.render(loaded.recipe, with_runtime=api == "trainjob", with_kueue=with_kueue).objects


def by_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def annotations(job):
    return [(t.get("metadata") or {}).get("annotations") or {} for _, t in kueue.pod_templates(job)]


# ----------------------------------------------------------------------------- the queued job


def test_a_queued_pytorchjob_is_created_suspended_with_its_topology_on_every_pod_set():
    job = rendered("cpu", "pytorchjob", QUEUE, "k8s.replicas=3", LEVELS, f"k8s.kueue.topology.required={RACK}")[-1]
    assert job["spec"]["runPolicy"]["suspend"] is True
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    assert [a.get(kueue.REQUIRED_TOPOLOGY) for a in annotations(job)] == [RACK, RACK]


def test_a_queued_trainjob_is_suspended_and_its_runtime_patch_carries_the_preferred_topology():
    objects = rendered("gaudi", "trainjob", QUEUE, LEVELS, f"k8s.kueue.topology.preferred={RACK}")
    job = objects[-1]
    assert job["spec"]["suspend"] is True
    (found,) = annotations(job)
    assert found == {kueue.PREFERRED_TOPOLOGY: RACK}
    assert kueue.REQUIRED_TOPOLOGY not in yaml.safe_dump(objects)


@pytest.mark.parametrize("overrides", [[], ["k8s.gang=volcano", QUEUE]])
def test_without_a_kueue_queue_nothing_is_suspended(overrides):
    job = rendered("cpu", "pytorchjob", *overrides)[-1]
    assert "suspend" not in job["spec"].get("runPolicy", {})
    assert "kueue.x-k8s.io" not in yaml.safe_dump(job)


def test_re_submitting_leaves_suspend_to_kueue():
    job = rendered("cpu", "pytorchjob", QUEUE)[-1]
    again = kueue.without_suspend(job)
    assert "suspend" not in again["spec"]["runPolicy"] and job["spec"]["runPolicy"]["suspend"] is True


# ----------------------------------------------------------------------------- render --kueue


def test_render_kueue_gives_the_team_queue_quota_flavor_and_topology():
    objects = rendered(
        "gaudi",
        "pytorchjob",
        QUEUE,
        "k8s.replicas=4",
        "k8s.kueue.quota_jobs=2",
        "k8s.node_selector.pool=gaudi2",
        LEVELS,
        f"k8s.kueue.topology.required={RACK}",
        with_kueue=True,
    )
    (topology,) = by_kind(objects, "Topology")
    (flavor,) = by_kind(objects, "ResourceFlavor")
    (cluster_queue,) = by_kind(objects, "ClusterQueue")
    (local_queue,) = by_kind(objects, "LocalQueue")
    assert [level["nodeLabel"] for level in topology["spec"]["levels"]] == [RACK, "kubernetes.io/hostname"]
    assert flavor["spec"] == {"nodeLabels": {"pool": "gaudi2"}, "topologyName": "kubetune"}
    assert local_queue["metadata"]["namespace"] == "kubetune" and local_queue["spec"]["clusterQueue"] == "team-a"
    assert cluster_queue["spec"]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kubetune"}}
    (group,) = cluster_queue["spec"]["resourceGroups"]
    (quota,) = group["flavors"]
    assert quota["name"] == flavor["metadata"]["name"] == "kubetune-gaudi"
    nominal = {q["name"]: parse_quantity(q["nominalQuota"]) for q in quota["resources"]}
    assert group["coveredResources"] == list(nominal)
    # 2 jobs of 4 workers of the gaudi profile's whole node (8 cards, 64 cores, 400Gi, 95000Mi hugepages)
    assert nominal == {
        "cpu": 2 * 4 * 64,
        "memory": 2 * 4 * 400 * 2**30,
        "habana.ai/gaudi": 2 * 4 * 8,
        "hugepages-2Mi": 2 * 4 * 95000 * 2**20,
    }
    assert objects[-1]["kind"] == "PyTorchJob"  # the queue objects come before the job they admit


def test_claimed_cards_are_not_in_the_quota_and_render_says_so():
    loaded = load_recipe(SEED, ["k8s.profile=gaudi", "k8s.devices=dra", "k8s.kubernetes_version='1.34'", QUEUE])
    out = r.render(loaded.recipe, with_kueue=True)
    (cluster_queue,) = by_kind(out.objects, "ClusterQueue")
    assert cluster_queue["spec"]["resourceGroups"][0]["coveredResources"] == ["cpu", "memory", "hugepages-2Mi"]
    assert any(w.startswith("--kueue with k8s.devices=dra: the pods claim their cards") for w in out.warnings)
    assert not any("--kueue" in w for w in r.render(loaded.recipe).warnings)


def test_the_queue_objects_are_shared_outside_the_job_kustomization(tmp_path):
    objects = rendered("cpu", "pytorchjob", QUEUE, with_kueue=True)
    written = r.write_dir(objects, tmp_path)
    listed = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())["resources"]
    queue_files = {r.file_name(o) for o in objects if kueue.is_team_object(o)}
    assert queue_files == {"localqueue-team-a.yaml", "clusterqueue-team-a.yaml", "resourceflavor-kubetune-cpu.yaml"}
    assert not queue_files & set(listed) and r.file_name(objects[-1]) in listed
    note = r.written_note(written, tmp_path, "kubetune")
    assert all(f"-f {tmp_path / name}" in note for name in queue_files)
    (flavor,) = by_kind(objects, "ResourceFlavor")
    assert flavor["spec"] == {"nodeLabels": {"feature.node.kubernetes.io/cpu-cpuid.AMXBF16": "true"}}


@pytest.mark.parametrize(
    "profile,api",
    [
        ("gaudi", "trainjob"),
        ("cpu", "pytorchjob"),
        *[
            pytest.param(p, a, marks=pytest.mark.slow)
            for p, a in (("gaudi", "pytorchjob"), ("nvidia", "pytorchjob"), ("nvidia", "trainjob"), ("cpu", "trainjob"))
        ],
    ],
)
def test_every_kueue_object_validates_with_schemas_and_cel_rules(profile, api, crd_dir):
    objects = rendered(
        profile,
        api,
        QUEUE,
        "k8s.node_selector.pool=train",
        LEVELS,
        f"k8s.kueue.topology.required={RACK}",
        with_kueue=True,
    )
    assert {o["kind"] for o in objects} >= set(kueue.TEAM_KINDS)
    assert validate_objects(objects, crd_dir=crd_dir) == []
    assert validate_objects(objects) == []  # the copies vendored in the package


@pytest.fixture(scope="module")
def queued_objects():
    return rendered(
        "gaudi",
        "pytorchjob",
        QUEUE,
        "k8s.node_selector.pool=train",
        LEVELS,
        f"k8s.kueue.topology.required={RACK}",
        with_kueue=True,
    )


def _broken(objects, kind, change):
    objects = copy.deepcopy(objects)
    change(by_kind(objects, kind)[0])
    return validate_objects(objects)


def test_cel_rules_catch_what_the_schema_cannot(queued_objects):
    def hostname_first(topology):
        topology["spec"]["levels"].reverse()

    def flavor_without_labels(flavor):
        del flavor["spec"]["nodeLabels"]

    def quota_short_of_a_resource(cluster_queue):
        cluster_queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"].pop()

    (problem,) = _broken(queued_objects, "Topology", hostname_first)
    assert problem.startswith("Topology/kubetune: spec/levels:") and "lowest level" in problem
    (problem,) = _broken(queued_objects, "ResourceFlavor", flavor_without_labels)
    assert problem.startswith("ResourceFlavor/kubetune-gaudi: spec:") and "nodeLabels" in problem
    (problem,) = _broken(queued_objects, "ClusterQueue", quota_short_of_a_resource)
    assert "flavors must have the same number of resources as the coveredResources" in problem
    assert validate_objects(queued_objects) == []


def test_a_topology_annotation_must_name_a_level_of_the_rendered_topology(queued_objects):
    def elsewhere(job):
        job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["annotations"][kueue.REQUIRED_TOPOLOGY] = (
            "example.com/block"
        )

    (problem,) = _broken(queued_objects, "PyTorchJob", elsewhere)
    assert problem.startswith("PyTorchJob/llama2-7b-medical-flashcards: spec/pytorchReplicaSpecs/Worker/template")
    assert "example.com/block is not a level of the Topology" in problem


@pytest.mark.parametrize(
    "overrides,with_kueue,expected",
    [
        (
            [QUEUE, LEVELS, f"k8s.kueue.topology.required={RACK}", f"k8s.kueue.topology.preferred={RACK}"],
            False,
            "k8s.kueue.topology.required and k8s.kueue.topology.preferred are both set",
        ),
        (
            [QUEUE, LEVELS, "k8s.kueue.topology.required=example.com/block"],
            False,
            (
                f"k8s.kueue.topology.required=example.com/block is not a level of the Topology; use one of "
                f"k8s.kueue.topology.levels: {RACK}, kubernetes.io/hostname"
            ),
        ),
        (
            [QUEUE, f"k8s.kueue.topology.preferred={RACK}"],
            False,
            f"k8s.kueue.topology.preferred={RACK} needs k8s.kueue.topology.levels",
        ),
        ([LEVELS, f"k8s.kueue.topology.required={RACK}"], False, "k8s.kueue.topology.required needs k8s.queue"),
        ([], True, "--kueue renders the LocalQueue k8s.queue and its ClusterQueue: set k8s.queue"),
        ([QUEUE, "k8s.gang=volcano"], True, "--kueue: with k8s.gang=volcano, k8s.queue is a Volcano queue"),
    ],
)
def test_impossible_kueue_requests_are_one_line_each(overrides, with_kueue, expected):
    with pytest.raises(RecipeError) as caught:
        rendered("nvidia", "pytorchjob", *overrides, with_kueue=with_kueue)
    assert expected in str(caught.value)


def test_a_topology_flavor_needs_node_labels():
    with pytest.raises(RecipeError, match=r"a ResourceFlavor of a Topology needs node labels; set k8s\.node_selector"):
        rendered("nvidia", "pytorchjob", QUEUE, LEVELS, with_kueue=True)


def test_cli_render_kueue_check(cli, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_a_made_up_token_for_the_check")  # Llama 2 is gated: --check wants a token
    result = cli("k8s", "render", SEED, QUEUE, "--kueue", "--check")
    assert result.code == 0, result.err
    kinds = [doc["kind"] for doc in yaml.safe_load_all(result.out) if doc]
    assert kinds.index("LocalQueue") < kinds.index("PyTorchJob") and "ClusterQueue" in kinds
    assert "Kueue" in result.err  # what --check checked them with
    bad = cli("k8s", "render", SEED, QUEUE, LEVELS, "k8s.kueue.topology.required=zone")
    assert bad.code == 2 and bad.err.count("\n") == 1 and "not a level of the Topology" in bad.err


# ----------------------------------------------------------------------------- doctor

NS, JOB = "kubetune", "run"


def job(kind="PyTorchJob", queue="team-a"):
    spec = {"runPolicy": {"suspend": True}} if kind == "PyTorchJob" else {"suspend": True}
    return {
        "apiVersion": "kubeflow.org/v1" if kind == "PyTorchJob" else "trainer.kubeflow.org/v1alpha1",
        "kind": kind,
        "metadata": {"name": JOB, "namespace": NS, "uid": "0b9f", "labels": {"kueue.x-k8s.io/queue-name": queue}},
        "spec": spec,
        "status": {"conditions": [{"type": "Suspended", "status": "True"}]},
    }


def condition(kind, status, reason, message):
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2026-12-01T10:00:00Z",
        "observedGeneration": 1,
    }


def workload(*conditions, owner="PyTorchJob", name=JOB, uid="0b9f"):
    """A Workload as Kueue writes it for a job (v1beta2): owned by the job, one pod set per role."""
    pod = {"spec": {"containers": [{"name": "pytorch", "image": "img", "resources": {"requests": {"cpu": "8"}}}]}}
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {
            "name": f"{owner.lower()}-{name}-5d3c1",
            "namespace": NS,
            "labels": {"kueue.x-k8s.io/job-uid": uid},
            "ownerReferences": [
                {
                    "apiVersion": "kubeflow.org/v1",
                    "kind": owner,
                    "name": name,
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "queueName": "team-a",
            "podSets": [
                {"name": "master", "count": 1, "template": pod},
                {"name": "worker", "count": 3, "template": pod},
            ],
        },
        "status": {"conditions": list(conditions)},
    }


PENDING_FOREVER = condition(
    "QuotaReserved",
    "False",
    "Pending",
    "couldn't assign flavors to pod set worker: insufficient quota for cpu in flavor kubetune-cpu, "
    "request > maximum capacity (32 > 16)",
)
PENDING_BUSY = condition(
    "QuotaReserved",
    "False",
    "Pending",
    "couldn't assign flavors to pod set worker: insufficient unused quota for cpu in flavor kubetune-cpu, "
    "8 more needed",
)
NO_LOCAL_QUEUE = condition("QuotaReserved", "False", "Inadmissible", "LocalQueue team-a doesn't exist")
PREEMPTED = condition("Evicted", "True", "Preempted", "Preempted to accommodate a higher priority Workload")
NOT_READY = condition("PodsReady", "False", "WaitForStart", "Not all pods are ready or succeeded")
ADMITTED = condition("Admitted", "True", "Admitted", "The workload is admitted")
RESERVED = condition("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue team-a")


# Kueue's Workload CRD, compressed: 1.4 MB stays out of the package (kubetune never renders one)
WORKLOAD_CRD = Path(__file__).parent / "crds" / "kueue.x-k8s.io_workloads.yaml.xz"
WORKLOAD_CRD_SHA256 = "1970ff6fcc5dc1a29e3f290ed736032c5d4509c94efe2c642d64a244ad1b8aa5"  # crds/README.md


def test_the_workload_fixtures_are_real_workloads():
    import hashlib
    import lzma

    import jsonschema

    text = lzma.decompress(WORKLOAD_CRD.read_bytes())
    assert hashlib.sha256(text).hexdigest() == WORKLOAD_CRD_SHA256, "not the upstream Workload CRD"
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # 1.4 MB of CRD: libyaml where installed
    crd = yaml.load(text, Loader=loader)
    (schema,) = [v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == "v1beta2"]
    validator = jsonschema.Draft4Validator(schema)
    for wl in (workload(PENDING_FOREVER), workload(PREEMPTED), workload(RESERVED, ADMITTED, NOT_READY)):
        assert list(validator.iter_errors(wl)) == []
    broken = workload(PENDING_BUSY)
    del broken["status"]["conditions"][0]["reason"]
    assert any("'reason' is a required property" in e.message for e in validator.iter_errors(broken))


def diagnosis(*conditions, missing_queue=False, kind="PyTorchJob"):
    snap = Snapshot(
        name=JOB,
        namespace=NS,
        job=job(kind),
        workload=workload(*conditions, owner=kind) if conditions else None,
        local_queue_missing=missing_queue,
        kueue_read=True,
    )
    found = [f for f in diagnose(snap) if "Kueue" in f.problem or "Workload" in f.subject]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize(
    "conditions,severity,problem,fix",
    [
        (
            (PENDING_FOREVER,),
            "error",
            (
                "not admitted by Kueue: Pending: couldn't assign flavors to pod set worker: "
                "insufficient quota for cpu in flavor kubetune-cpu, request > maximum capacity (32 > 16)"
            ),
            "never fits: raise that resource's nominalQuota",
        ),
        (
            (PENDING_BUSY,),
            "error",
            "8 more needed",
            "other Workloads hold the quota (`kubectl get workloads -n kubetune`)",
        ),
        ((NO_LOCAL_QUEUE,), "error", "Inadmissible: LocalQueue team-a doesn't exist", "render RECIPE --kueue"),
        (
            (RESERVED, PREEMPTED),
            "error",
            "evicted by Kueue: Preempted: Preempted to accommodate a higher priority",
            "raise k8s.priority_value",
        ),
        (
            (RESERVED, ADMITTED, NOT_READY),
            "warning",
            "admitted by Kueue, its pods not ready: WaitForStart",
            "see the pod findings",
        ),
        ((RESERVED,), "warning", "quota reserved, waiting for its admission checks", "admissionChecks"),
    ],
)
def test_doctor_explains_a_workload_that_is_not_admitted(conditions, severity, problem, fix):
    found = diagnosis(*conditions)
    assert found.severity == severity and problem in found.problem and fix in found.fix
    assert found.subject == f"PyTorchJob {JOB} (Workload pytorchjob-{JOB}-5d3c1)"


def test_doctor_on_a_missing_local_queue_and_on_a_job_kueue_ignores():
    missing = diagnosis(missing_queue=True, kind="TrainJob")
    assert missing.severity == "error" and "LocalQueue team-a does not exist in namespace kubetune" in missing.problem
    assert "is Kueue installed?" in missing.fix  # no Workload either
    ignored = diagnosis(kind="TrainJob")
    assert "Kueue made no Workload for it" in ignored.problem
    assert "trainer.kubeflow.org/trainjob" in ignored.fix


def test_the_workload_is_found_by_owner_or_by_the_job_uid():
    other = workload(PENDING_BUSY, name="other-job", uid="77aa")
    mine = workload(PENDING_BUSY)
    assert kueue.workload_of([other, mine], job()) is mine
    del mine["metadata"]["ownerReferences"]
    assert kueue.workload_of([other, mine], job()) is mine  # kueue.x-k8s.io/job-uid
    mine["metadata"]["labels"] = {}
    assert kueue.workload_of([other, mine], job()) is None


# ----------------------------------------------------------------------------- against the API


def test_doctor_reads_the_workload_and_the_local_queue_from_the_api(cli, kube, tmp_path):
    recipe = "smollm2-135m-lora-cpu"
    assert cli("k8s", "submit", recipe, QUEUE).code == 0
    live = kube.objects("kubeflow.org/v1/pytorchjobs")[(NS, recipe)]
    assert live["spec"]["runPolicy"]["suspend"] is True
    client = kube.client()
    client.create(workload(NO_LOCAL_QUEUE, name=recipe))
    result = cli("k8s", "doctor", recipe)
    assert result.code == 1
    assert f"[error] PyTorchJob {recipe}: suspended in Kueue queue team-a, but LocalQueue team-a does not exist" in (
        result.out
    )
    queue = by_kind(rendered("cpu", "pytorchjob", QUEUE, with_kueue=True), "LocalQueue")[0]
    client.create(queue)
    result = cli("k8s", "doctor", recipe)
    assert f"(Workload pytorchjob-{recipe}-5d3c1): not admitted by Kueue: Inadmissible: LocalQueue team-a" in result.out


def test_submitting_again_leaves_an_admitted_job_running(cli, kube):
    recipe = "smollm2-135m-lora-cpu"
    assert cli("k8s", "submit", recipe, QUEUE).code == 0
    kube.client().patch(  # what Kueue does on admission
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": recipe, "namespace": NS},
            "spec": {"runPolicy": {"suspend": False}},
        }
    )
    again = cli("k8s", "submit", recipe, QUEUE)
    assert again.code == 0, again.err
    assert kube.objects("kubeflow.org/v1/pytorchjobs")[(NS, recipe)]["spec"]["runPolicy"]["suspend"] is False
