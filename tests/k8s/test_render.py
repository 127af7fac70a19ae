"""Render: snapshots and invariants for every profile x API, and both validators on the output.

Snapshots live in tests/k8s/snapshots/; after an intended change regenerate them with
    KUBETUNE_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/k8s/test_render.py
and review the diff.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

from kubetune.errors import RecipeError
from kubetune.k8s import render as r
from kubetune.k8s.validate import validate_objects
from kubetune.recipe.loader import load_recipe

from .conftest import TOKEN

PROFILES = ("cpu", "gaudi", "nvidia")
APIS = ("pytorchjob", "trainjob")
SNAPSHOTS = Path(__file__).parent / "snapshots"
SEED = "llama2-7b-medical-flashcards"
GAUDI_SEED = "llama2-13b-gaudi-tp4-pp8"
CLUSTER_SCOPED = {"Namespace", "PriorityClass", "ClusterTrainingRuntime"}


def rendered(profile="cpu", api="pytorchjob", *overrides, token=TOKEN, with_runtime=None, recipe=SEED):
    loaded = load_recipe(recipe, [f"k8s.profile={profile}", f"k8s.api={api}", *overrides])
    return r.render(
        loaded.recipe, hf_token=token, with_runtime=(api == "trainjob") if with_runtime is None else with_runtime
    )


def by_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def pod_specs(objects):
    """Every pod spec that will run: worker templates, the data pod, TrainJob trainer + patch."""
    specs = []
    for obj in objects:
        if obj["kind"] == "Pod":
            specs.append(obj["spec"])
        elif obj["kind"] == "PyTorchJob":
            specs += [rs["template"]["spec"] for rs in obj["spec"]["pytorchReplicaSpecs"].values()]
    return specs


def first_pod_spec(job):
    """The pod spec of a PyTorchJob's first replica type: Master, or Worker in an elastic job (seed 002's)."""
    return next(iter(job["spec"]["pytorchReplicaSpecs"].values()))["template"]["spec"]


def worker_container(objects):
    job = objects[-1]
    if job["kind"] == "PyTorchJob":
        return first_pod_spec(job)["containers"][0]
    trainer = job["spec"]["trainer"]
    return {
        "name": "node",
        "env": trainer["env"],
        "resources": trainer["resourcesPerNode"],
        "command": trainer["command"],
    }


def env_of(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


ALL = [(p, a) for p in PROFILES for a in APIS]


def _snapshot_cases():
    yield from ((SEED, profile, api, f"{profile}-{api}.yaml") for profile, api in ALL)
    # seed 000's layout: 8 Gaudi pods x 4 cards, tp 4 x pp 8
    yield from ((GAUDI_SEED, "gaudi", api, f"gaudi-tp4-pp8-{api}.yaml") for api in APIS)


@pytest.mark.parametrize("recipe,profile,api,name", list(_snapshot_cases()))
def test_snapshot(recipe, profile, api, name):
    objects = rendered(profile, api, recipe=recipe).objects
    # The recipe dump grows with every new recipe key (other layers add them): its content is
    # checked by test_container_runs_kubetune_train_on_the_mounted_recipe, not snapshotted.
    for cm in by_kind(objects, "ConfigMap"):
        cm["data"]["recipe.yaml"] = "<the resolved recipe>"
    # all that render makes (the output's default omits the Namespace and the PodMonitor)
    text = r.to_yaml(objects, create_namespace=True, prometheus_operator=True)
    path = SNAPSHOTS / name
    if os.environ.get("KUBETUNE_UPDATE_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"missing snapshot {path.name}: run with KUBETUNE_UPDATE_SNAPSHOTS=1"
    assert text == path.read_text(), f"render changed; if intended, regenerate {path.name} (see module docstring)"


@pytest.mark.parametrize("profile,api", ALL)
def test_both_validators_pass(profile, api, crd_dir):
    objects = rendered(profile, api).objects
    assert validate_objects(objects, crd_dir=crd_dir) == []
    assert validate_objects(objects) == []  # the CRD copies vendored in the package


@pytest.mark.parametrize(
    "overrides",
    [
        ["k8s.gang=coscheduling", "k8s.quota=true", "k8s.priority_class=train-high", "k8s.priority_value=1000"],
        ["k8s.gang=volcano", "k8s.queue=research", "k8s.replicas=4"],
        ["k8s.elastic.enabled=true", "k8s.elastic.min_replicas=2", "k8s.elastic.max_replicas=4", "k8s.replicas=3"],
        [
            "k8s.queue=team-a",
            "k8s.node_selector.pool=train",
            "k8s.tolerations=[{key: dedicated, operator: Exists}]",
            "k8s.storage.existing_claim=shared-nfs",
            "k8s.resources.cpu=16",
            "k8s.image_pull_policy=Always",
        ],
    ],
)
@pytest.mark.parametrize("profile", PROFILES)
def test_variants_validate(profile, overrides, crd_dir):
    api_choices = ["pytorchjob"] if any("elastic" in o for o in overrides) else list(APIS)
    for api in api_choices:
        objects = rendered(profile, api, *overrides).objects
        assert validate_objects(objects, crd_dir=crd_dir) == [], (profile, api, overrides)


@pytest.mark.parametrize("profile,api", ALL)
def test_every_object_in_the_job_namespace(profile, api):
    objects = rendered(
        profile,
        api,
        "k8s.namespace=team-ml",
        "k8s.quota=true",
        "k8s.gang=coscheduling",
        "k8s.priority_class=hi",
        "k8s.priority_value=10",
    ).objects
    for obj in objects:
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], obj["kind"]
        else:
            assert obj["metadata"]["namespace"] == "team-ml", obj["kind"]
    assert by_kind(objects, "Namespace")[0]["metadata"]["name"] == "team-ml"
    assert by_kind(objects, "Pod")[0]["metadata"]["name"].endswith("-data")  # the data-access pod, same namespace


@pytest.mark.parametrize("profile,api", ALL)
def test_guaranteed_qos_everywhere(profile, api):
    """Requests equal limits (cpu and memory set) in every container that runs."""
    objects = rendered(profile, api).objects
    containers = [c for spec in pod_specs(objects) for c in spec["containers"]]
    if api == "trainjob":
        containers.append(worker_container(objects))
    assert containers
    for c in containers:
        res = c["resources"]
        assert res["requests"] == res["limits"], c["name"]
        assert {"cpu", "memory"} <= set(res["limits"]), c["name"]


@pytest.mark.parametrize("profile,api", ALL)
def test_the_hf_token_is_only_in_the_secret(profile, api):
    objects = rendered(profile, api).objects
    (secret,) = by_kind(objects, "Secret")
    assert TOKEN not in yaml.safe_dump(secret)  # base64 in data, never in clear text
    for obj in objects:
        if obj["kind"] != "Secret":
            assert TOKEN not in yaml.safe_dump(obj), obj["kind"]
    assert TOKEN not in r.to_yaml(objects)  # stdout: the Secret is replaced by a comment
    assert "# Secret llama2-7b-medical-flashcards-hf-token: not printed" in r.to_yaml(objects)
    token_env = env_of(worker_container(objects))["HF_TOKEN"]
    assert token_env == {  # Llama 2 is gated: the pods wait for the Secret (tests/k8s/test_gated_token.py)
        "secretKeyRef": {"key": "HF_TOKEN", "name": "llama2-7b-medical-flashcards-hf-token", "optional": False}
    }


def test_no_token_no_secret():
    objects = rendered(token=None).objects
    assert by_kind(objects, "Secret") == []
    assert "HF_TOKEN" in env_of(worker_container(objects))  # the Secret the user creates (a warning says so)


def test_a_token_in_the_recipe_is_refused():
    with pytest.raises(RecipeError, match="token appears in ConfigMap"):
        rendered("cpu", "pytorchjob", f"comm.extra_env.HUGGING_FACE_HUB_TOKEN={TOKEN}")


@pytest.mark.parametrize("profile,api", ALL)
def test_container_runs_kubetune_train_on_the_mounted_recipe(profile, api):
    objects = rendered(profile, api).objects
    container = worker_container(objects)
    assert container["name"] == {"pytorchjob": "pytorch", "trainjob": "node"}[api]
    assert container["command"] == ["kubetune", "train", "/etc/kubetune/recipe.yaml"]
    env = env_of(container)
    assert env["KUBETUNE_CACHE"] == "/data/cache" and env["HF_HOME"] == "/data/hf"
    (cm,) = by_kind(objects, "ConfigMap")
    recipe = yaml.safe_load(cm["data"]["recipe.yaml"])
    assert recipe["output_dir"] == "/data/runs/llama2-7b-medical-flashcards"
    assert recipe["train"]["resume"] == "auto"


def test_output_dir_is_moved_onto_the_pvc():
    objects = rendered(recipe="smollm2-135m-lora-cpu", token=None).objects
    recipe = yaml.safe_load(by_kind(objects, "ConfigMap")[0]["data"]["recipe.yaml"])
    assert recipe["output_dir"] == "/data/runs/smollm2-135m-lora-cpu"  # was runs/smollm2-135m-lora-cpu


def test_volumes_mounts_and_shm():
    objects = rendered("cpu", "pytorchjob", "k8s.resources.shm_size=8Gi").objects
    spec = objects[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "llama2-7b-medical-flashcards-data"
    assert volumes["recipe"]["configMap"]["name"] == "llama2-7b-medical-flashcards-recipe"
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts == {"/etc/kubetune": "recipe", "/data": "data", "/dev/shm": "dshm"}
    (pvc,) = by_kind(objects, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_cpu_profile_threads_affinity_and_memory_headroom():
    objects = rendered("cpu", "pytorchjob", "k8s.resources.cpu=200", "k8s.resources.memory=226Gi").objects
    container = worker_container(objects)
    env = env_of(container)
    assert env["OMP_NUM_THREADS"] == "200"  # one process per pod: all of the CPU limit
    assert env["OMP_PROC_BIND"] == "close" and env["OMP_PLACES"] == "cores"
    assert int(env["KUBETUNE_MEMORY_BUDGET"]) == int(226 * 2**30 * 0.95)
    spec = first_pod_spec(objects[-1])
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"] == [
        {"key": "feature.node.kubernetes.io/cpu-cpuid.AMXBF16", "operator": "In", "values": ["true"]}
    ]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert "hostIPC" not in spec
    two = env_of(
        worker_container(rendered("cpu", "pytorchjob", "k8s.resources.cpu=16", "k8s.nproc_per_node=2").objects)
    )
    assert two["OMP_NUM_THREADS"] == "8" and two["OMP_PROC_BIND"] == "false"  # no binding with 2 processes
    no_amx = rendered("cpu", "pytorchjob", "k8s.amx_label=null").objects
    assert "affinity" not in first_pod_spec(no_amx[-1])


def test_gaudi_profile():
    objects = rendered("gaudi", "pytorchjob", "comm.hccl.over_ofi=true").objects
    spec = first_pod_spec(objects[-1])
    container = spec["containers"][0]
    assert container["resources"]["limits"]["habana.ai/gaudi"] == "8"
    assert container["resources"]["limits"]["hugepages-2Mi"] == "95000Mi"
    assert spec["hostIPC"] is True
    assert container["securityContext"]["capabilities"]["add"] == ["SYS_NICE"]
    assert {"key": "habana.ai/gaudi", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert env_of(container)["HCCL_OVER_OFI"] == "1"
    assert not any(k.startswith("NCCL_") for k in env_of(container))
    assert objects[-1]["spec"]["nprocPerNode"] == "8"


def test_nvidia_profile():
    objects = rendered(
        "nvidia",
        "pytorchjob",
        "k8s.resources.accelerators=4",
        "comm.nccl.algo=Ring",
        "comm.nccl.proto=Simple",
        "comm.nccl.buffsize=8388608",
        "comm.nccl.nsocks_perthread=4",
    ).objects
    container = worker_container(objects)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    env = env_of(container)
    assert (env["NCCL_ALGO"], env["NCCL_PROTO"], env["NCCL_BUFFSIZE"], env["NCCL_NSOCKS_PERTHREAD"]) == (
        "Ring",
        "Simple",
        "8388608",
        "4",
    )
    assert env["OMP_NUM_THREADS"] == "2"  # 8 CPUs / 4 processes
    assert not any(k.startswith("HCCL_") for k in env)


def test_pytorchjob_master_workers_and_elastic():
    job = rendered("cpu", "pytorchjob", "k8s.replicas=4", "k8s.elastic.enabled=false").objects[-1]
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 3)
    assert specs["Master"]["restartPolicy"] == "OnFailure"
    assert specs["Master"]["template"]["spec"]["containers"][0]["ports"] == [
        {"containerPort": 23456, "name": "pytorchjob-port"},
        {"containerPort": 9450, "name": "metrics"},  # monitor.in_cluster (tests/monitor/test_objects.py)
    ]
    single = rendered("cpu", "pytorchjob", "k8s.replicas=1", "k8s.elastic.enabled=false").objects[-1]
    assert list(single["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    elastic = rendered(
        "cpu",
        "pytorchjob",
        "k8s.elastic.enabled=true",
        "k8s.elastic.min_replicas=2",
        "k8s.elastic.max_replicas=4",
        "k8s.replicas=3",
    ).objects[-1]["spec"]
    assert list(elastic["pytorchReplicaSpecs"]) == ["Worker"]
    assert elastic["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    assert elastic["elasticPolicy"] == {"maxReplicas": 4, "maxRestarts": 3, "minReplicas": 2, "rdzvBackend": "c10d"}


def test_trainjob_refs_runtime_and_patches_volumes():
    job = rendered("cpu", "trainjob", with_runtime=False).objects[-1]
    assert job["spec"]["runtimeRef"] == {
        "name": "torch-distributed",
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
    }
    assert job["spec"]["trainer"]["numNodes"] == 4  # the seed recipe's k8s.replicas
    (patch,) = job["spec"]["runtimePatches"]
    (rj,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rj["name"] == "node"
    pod = rj["template"]["spec"]["template"]["spec"]
    assert {v["name"] for v in pod["volumes"]} == {"recipe", "data", "dshm"}
    assert pod["containers"][0]["name"] == "node"
    objects = rendered("gaudi", "trainjob", "k8s.gang=volcano", with_runtime=True).objects
    (runtime,) = by_kind(objects, "ClusterTrainingRuntime")
    assert (
        objects[-1]["spec"]["runtimeRef"]["name"]
        == runtime["metadata"]["name"]
        == "llama2-7b-medical-flashcards-runtime"
    )
    node_spec = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert node_spec["hostIPC"] is True and node_spec["schedulerName"] == "volcano"
    assert runtime["spec"]["podGroupPolicy"] == {"volcano": {}}
    assert by_kind(objects, "PodGroup") == []  # the Trainer creates it from podGroupPolicy


def test_trainjob_without_runtime_warns_about_what_it_cannot_set():
    result = rendered("gaudi", "trainjob", "k8s.priority_class=hi", with_runtime=False)
    assert any("hostIPC (gaudi)" in w and "k8s.priority_class" in w and "--with-runtime" in w for w in result.warnings)


def test_gang_scheduling_and_queues():
    objects = rendered("cpu", "pytorchjob", "k8s.gang=coscheduling", "k8s.replicas=3", "k8s.queue=team-a").objects
    (pg,) = by_kind(objects, "PodGroup")
    assert pg["apiVersion"] == "scheduling.x-k8s.io/v1alpha1" and pg["spec"]["minMember"] == 3
    job = objects[-1]
    tmpl = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    assert tmpl["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == job["metadata"]["name"]
    assert tmpl["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    volcano = rendered("cpu", "pytorchjob", "k8s.gang=volcano", "k8s.queue=research").objects
    (vpg,) = by_kind(volcano, "PodGroup")
    assert vpg["apiVersion"] == "scheduling.volcano.sh/v1beta1" and vpg["spec"]["queue"] == "research"
    vjob = volcano[-1]
    assert "kueue.x-k8s.io/queue-name" not in vjob["metadata"]["labels"]  # a Volcano queue, not Kueue's
    assert vjob["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 4, "queue": "research"}


def test_quota_covers_workers_and_the_data_pod():
    objects = rendered(
        "gaudi", "pytorchjob", "k8s.quota=true", "k8s.replicas=2", "k8s.resources.cpu=10", "k8s.resources.memory=100Gi"
    ).objects
    (quota,) = by_kind(objects, "ResourceQuota")
    hard = quota["spec"]["hard"]
    assert hard["requests.cpu"] == hard["limits.cpu"] == "20250m"
    assert hard["requests.memory"] == "205056Mi"  # 2 x 100Gi + 256Mi
    assert hard["requests.habana.ai/gaudi"] == "16"
    assert hard["requests.hugepages-2Mi"] == "190000Mi"
    assert hard["pods"] == "3" and hard["persistentvolumeclaims"] == "1"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["k8s.resources.cpu=0"], "k8s.resources.cpu must be more than 0"),
        (["k8s.resources.shm_size=40Gi", "k8s.resources.memory=32Gi"], "shm_size 40Gi must be smaller than"),
        (["k8s.resources.accelerators=2"], "accelerators=2 on the cpu profile"),
        (["k8s.nproc_per_node=300"], "exceeds the 200 CPUs per pod"),
        (["k8s.storage.access_mode=ReadWriteOnce"], "ReadWriteOnce cannot be shared"),
        (["k8s.elastic.enabled=true", "k8s.elastic.max_replicas=1"], "must lie within elastic"),
        (["parallel.tp=4", "k8s.replicas=3"], "k8s.replicas=3 x k8s.nproc_per_node=1 = 3 processes"),
        (
            ["parallel.pp=2", "k8s.replicas=4", "k8s.elastic.enabled=true", "k8s.elastic.min_replicas=3"],
            "dp x fsdp x tp x pp = 1 x 1 x 1 x 2 = 2, but 3 process(es)",
        ),
    ],
)
def test_impossible_resources_are_one_error(overrides, message):
    with pytest.raises(RecipeError) as err:
        rendered("cpu", "pytorchjob", *overrides)
    assert len(err.value.problems) == 1 and message in err.value.problems[0]


def test_local_data_paths_warn(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    result = rendered("cpu", "pytorchjob", f"data.train={data}", "train.resume=never")
    assert any("data.train" in w and "the pods cannot see" in w for w in result.warnings)
    assert any("train.resume=never" in w for w in result.warnings)


def test_job_name_is_a_dns_label():
    loaded = load_recipe("smollm2-135m-lora-cpu", ["output_dir=runs/My_Run.v2/"])
    assert r.job_name(loaded.recipe) == "my-run-v2"


def test_write_dir_files_kustomization_and_secret_mode(tmp_path):
    objects = rendered("cpu", "pytorchjob").objects
    written = r.write_dir(objects, tmp_path, prometheus_operator=True)
    kustomization = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())
    assert kustomization["resources"] == [p.name for p in written[:-1]]
    secret_file = tmp_path / "secret-llama2-7b-medical-flashcards-hf-token.yaml"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    assert objects[0]["kind"] == "Namespace"  # rendered for submit, never written unless asked for
    assert [yaml.safe_load(p.read_text()) for p in written[:-1]] == objects[1:]
    assert not list(tmp_path.glob("namespace-*.yaml"))


def test_write_dir_keeps_the_pod_monitor_out_of_the_kustomization_unless_the_operator_is_there(tmp_path):
    objects = rendered("cpu", "pytorchjob").objects
    written = r.write_dir(objects, tmp_path)
    listed = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())["resources"]
    (monitor,) = [p for p in written if p.name.startswith("podmonitor-")]
    assert monitor.name not in listed and len(listed) == len(written) - 2  # beside it: the monitor
    assert monitor.read_text().startswith("# Not in kustomization.yaml: a PodMonitor needs the Prometheus Operator")
    note = r.written_note(written, tmp_path, "kubetune")
    assert f"`kubectl apply -f {monitor}` once kube-prometheus-stack is installed" in note
    assert "after `kubectl create -f" not in note  # it is not shared: nothing to create once


def test_a_cjk_template_is_stored_as_its_characters_and_still_validates(tmp_path):
    # seen: the ConfigMap held "\u95EE\u9898..." escapes, which nobody reviewing the manifests can read
    from kubetune.k8s.objects import config_map_recipe

    template, system = "问题：{instruction} 回答：", "你是一名医生。"
    objects = rendered("cpu", "pytorchjob", f"data.template='{template}'", f"data.system_prompt='{system}'").objects
    (cm,) = by_kind(objects, "ConfigMap")
    stored = cm["data"]["recipe.yaml"]
    assert template in stored and system in stored and "\\u" not in stored
    assert validate_objects(objects) == []
    printed = r.to_yaml(objects)
    assert template in printed and "\\u" not in printed
    written = [p for p in r.write_dir(objects, tmp_path) if p.name.startswith("configmap-")]
    (again,) = [yaml.safe_load(p.read_text(encoding="utf-8")) for p in written]
    assert again == cm and config_map_recipe(again).data.template == template  # as the pods read it back


# ------------------------------------------------------------------- the validators can fail


def _mutated(fn):
    objects = copy.deepcopy(rendered("cpu", "pytorchjob").objects)
    fn(objects)
    return objects


def test_crd_validator_catches_wrong_types_and_unknown_fields(crd_dir):
    def bad_replicas(objects):
        objects[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "two"

    problems = validate_objects(_mutated(bad_replicas), crd_dir=crd_dir)
    assert problems == [
        (
            "PyTorchJob/llama2-7b-medical-flashcards: spec/pytorchReplicaSpecs/Worker/replicas: "
            "'two' is not of type 'integer'"
        )
    ]

    def typo(objects):
        objects[-1]["spec"]["runPolicy"]["cleanPodPolcy"] = "All"

    assert any("runPolicy/cleanPodPolcy: unknown field" in p for p in validate_objects(_mutated(typo), crd_dir))


def test_core_validator_is_strict():
    def extra_field(objects):
        by_kind(objects, "Pod")[0]["spec"]["containers"][0]["imagePullPolice"] = "Always"

    problems = validate_objects(_mutated(extra_field))
    assert len(problems) == 1 and problems[0].startswith("Pod/llama2-7b-medical-flashcards-data:")
    assert "imagePullPolice" in problems[0]


def test_uncheckable_objects_fail(tmp_path):
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert validate_objects([unknown]) == ["Widget/w: cannot check: no schema for Widget example.com/v1"]
    job = rendered("cpu", "pytorchjob").objects[-1]
    (problem,) = validate_objects([job], crd_dir=tmp_path)
    assert "cannot check: CRD schema" in problem and "is missing" in problem


def test_vendored_crds_are_the_upstream_files_their_readme_names(crd_dir):
    """Each CRD the validator reads is the upstream file whose sha256 the README records (copied
    unchanged, byte for byte): an edited or re-downloaded copy must come with its new row."""
    import hashlib
    import re

    from kubetune.k8s.validate import CRD_FILES

    readme = (crd_dir / "README.md").read_text()
    recorded = dict(re.findall(r"^\| `([\w.-]+\.yaml)` \|.*\| `([0-9a-f]{64})` \|$", readme, re.MULTILINE))
    assert set(recorded) == set(CRD_FILES.values()) == {p.name for p in crd_dir.glob("*.yaml")}
    for name, digest in recorded.items():
        assert hashlib.sha256((crd_dir / name).read_bytes()).hexdigest() == digest, name
    assert "Apache License" in readme


def test_trainjob_matches_the_trainer_sdk_model():
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    job = rendered("nvidia", "trainjob").objects[-1]
    assert TrainerV1alpha1TrainJob.from_dict(job).to_dict() == job


@pytest.mark.parametrize(("profile", "tag"), [("cpu", "0.1.0"), ("nvidia", "0.1.0-cuda"), ("gaudi", "0.1.0-gaudi")])
def test_each_profile_runs_the_image_built_for_its_hardware(profile, tag):
    # a CPU torch cannot drive a GPU or a Gaudi card: the default image follows the profile
    recipe = load_recipe("smollm2-135m-lora-cpu", [f"k8s.profile={profile}"]).recipe
    assert recipe.k8s.container_image() == f"ghcr.io/kubetune/kubetune:{tag}"
    chosen = load_recipe("smollm2-135m-lora-cpu", [f"k8s.profile={profile}", "k8s.image=reg.example/kt:9"]).recipe
    assert chosen.k8s.container_image() == "reg.example/kt:9"


TRACKING = ["monitor.tracking_env_from.secret=tracking-creds", "monitor.tracking_env_from.config_map=tracking-settings"]
TRACKING_ENV_FROM = [{"configMapRef": {"name": "tracking-settings"}}, {"secretRef": {"name": "tracking-creds"}}]


@pytest.mark.parametrize("profile", PROFILES)
def test_tracking_env_from_reaches_every_training_pod_and_validates(profile, crd_dir):
    objects = rendered(profile, "pytorchjob", *TRACKING).objects
    job = by_kind(objects, "PyTorchJob")[0]
    containers = [rs["template"]["spec"]["containers"][0] for rs in job["spec"]["pytorchReplicaSpecs"].values()]
    assert containers and all(c["envFrom"] == TRACKING_ENV_FROM for c in containers)
    assert validate_objects(objects, crd_dir=crd_dir) == []
    assert "envFrom" not in worker_container(rendered(profile, "pytorchjob").objects)  # unset: none


def test_tracking_env_from_in_a_trainjob_rides_on_its_runtime(crd_dir):
    result = rendered("cpu", "trainjob", *TRACKING, with_runtime=True)
    runtime = by_kind(result.objects, "ClusterTrainingRuntime")[0]
    node = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert node["containers"][0]["envFrom"] == TRACKING_ENV_FROM
    assert validate_objects(result.objects, crd_dir=crd_dir) == []
    without = rendered("cpu", "trainjob", *TRACKING, with_runtime=False)
    assert any("monitor.tracking_env_from" in w for w in without.warnings), without.warnings


def test_render_check_passes_with_tracking_env_from():
    from tests.kit.cli import run_cli_redirected

    result = run_cli_redirected("k8s", "render", "smollm2-135m-lora-cpu", "--check", *TRACKING)
    assert result.code == 0, result.err
    job = next(o for o in yaml.safe_load_all(result.out) if o and o["kind"] == "PyTorchJob")
    assert first_pod_spec(job)["containers"][0]["envFrom"] == TRACKING_ENV_FROM
