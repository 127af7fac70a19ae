"""`kubetune k8s render-serve`: each serving object's key fields, strict validation for every
profile x engine, snapshots, the command writing -o DIR, bad input, and submit / status /
delete of the serving objects (the fake client and the in-memory API server).

Snapshots: regenerate after an intended change with
    KUBETUNE_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/k8s/test_render_serve.py
and review the diff.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kubetune.contracts.serving import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PORT,
    DRAIN_TIMEOUT_S,
    HEALTH_PATH,
    READY_PATH,
    VLLM_READY_PATH,
    WAITING_METRIC,
    Adapter,
    VllmOptions,
    vllm_argv,
    vllm_cpu_kvcache_gib,
    vllm_lora_rank,
)
from kubetune.errors import RecipeError, UserError
from kubetune.k8s import follow
from kubetune.k8s import render as r
from kubetune.k8s.serve import ENGINES, ServeSettings
from kubetune.k8s.serve.argv import API_KEY_SECRET_KEY
from kubetune.k8s.serve.network import nginx_size
from kubetune.k8s.serve.plan import GAUDI_VLLM_WARMUP_S, UNKNOWN_LOAD_S, load_source, model_params
from kubetune.k8s.serve.render import render_serve
from kubetune.k8s.serve.settings import flags_given, setting_options, spec_given
from kubetune.k8s.validate import validate_objects
from kubetune.recipe.k8s import PROFILE_IMAGES, VLLM_IMAGES
from kubetune.recipe.loader import load_recipe
from kubetune.rundir import RunDir

from .conftest import TOKEN
from .fakes import FakeClient

pytestmark = pytest.mark.process

SMOL = "smollm2-135m-lora-cpu"  # LoRA over the embedded GGUF default
SEED = "llama2-7b-medical-flashcards"  # LoRA over a hub model (32 heads: tensor parallel 8 fits)
JOB, NS = SMOL, "kubetune"
SERVE = f"{JOB}-serve"
SNAPSHOTS = Path(__file__).parent / "snapshots"
PROFILES = ("cpu", "gaudi", "nvidia")


def rendered(recipe=SMOL, *overrides, profile="cpu", token=None, **settings):
    loaded = load_recipe(recipe, [f"k8s.profile={profile}", *overrides])
    return render_serve(loaded.recipe, ServeSettings(**settings), hf_token=token)


def one(objects, kind):
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


def server(objects):
    return one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def env_of(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# ------------------------------------------------------------------------------ the objects


def test_objects_in_apply_order_all_in_the_jobs_namespace():
    out = rendered(token=TOKEN)
    kinds = [o["kind"] for o in out.objects]
    assert kinds == [
        "Namespace",
        "Secret",
        "NetworkPolicy",  # before the Deployment: no pod runs unguarded
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ServiceMonitor",  # monitor.in_cluster (tests/monitor/test_objects.py)
        "HorizontalPodAutoscaler",
        "Ingress",
    ]
    assert {o["metadata"].get("namespace") for o in out.objects[1:]} == {NS}
    # the token goes into the training job's Secret, the one the serving pods read: the job's instance
    secret = one(out.objects, "Secret")
    assert out.names.job == SERVE and secret["metadata"]["name"] == f"{JOB}-hf-token"
    assert secret["metadata"]["labels"]["app.kubernetes.io/instance"] == JOB
    for obj in out.objects[1:]:
        labels = obj["metadata"]["labels"]
        instance = JOB if obj is secret else SERVE
        assert labels["app.kubernetes.io/instance"] == instance and labels["app.kubernetes.io/managed-by"] == "kubetune"


def test_native_engine_serves_the_run_directory_from_the_jobs_claim():
    out = rendered(adapters=(Adapter("cardio", "runs/cardio"), Adapter("derm", "/data/teams/derm")))
    container = server(out.objects)
    assert container["command"] == [
        "kubetune",
        "serve",
        f"/data/runs/{JOB}",  # where the training job writes output_dir (render.cluster_recipe)
        "--host",
        "0.0.0.0",
        "--port",
        str(DEFAULT_PORT),
        "--engine",
        "native",
        "--adapter",
        "cardio=/data/runs/cardio",  # relative: under the volume's root
        "--adapter",
        "derm=/data/teams/derm",
    ]
    assert container["image"] == PROFILE_IMAGES["cpu"]
    pod = one(out.objects, "Deployment")["spec"]["template"]["spec"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": f"{JOB}-data"}} in pod["volumes"]
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    assert env_of(container)["HF_HOME"] == "/data/hf" and env_of(container)["KUBETUNE_CACHE"] == "/data/cache"
    assert pod["automountServiceAccountToken"] is False
    claimed = server(rendered(SMOL, "k8s.storage.existing_claim=team-nfs", "output_dir=/data/team/run7").objects)
    assert claimed["command"][2] == "/data/team/run7"
    assert one(rendered(SMOL, "k8s.storage.existing_claim=team-nfs").objects, "Deployment")["spec"]["template"]["spec"][
        "volumes"
    ][0] == {"name": "data", "persistentVolumeClaim": {"claimName": "team-nfs"}}


def test_model_image_is_copied_into_an_empty_dir_before_the_server_starts():
    out = rendered(model_image="registry.example.com/runs/smol:1")
    pod = one(out.objects, "Deployment")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["image"] == "registry.example.com/runs/smol:1"
    assert init["command"] == ["cp", "-R", "/model/.", f"/models/{JOB}"]
    assert init["resources"]["requests"] == init["resources"]["limits"]  # the pod stays Guaranteed
    assert {"name": "models", "emptyDir": {}} in pod["volumes"]
    assert not any("persistentVolumeClaim" in v for v in pod["volumes"])
    assert server(out.objects)["command"][2] == f"/models/{JOB}"


def test_probes_come_from_the_contract_and_startup_covers_loading():
    native, vllm = server(rendered().objects), server(rendered(engine="vllm").objects)
    for container, ready in ((native, READY_PATH), (vllm, VLLM_READY_PATH)):
        assert container["readinessProbe"]["httpGet"] == {"path": ready, "port": "http"}
        assert container["startupProbe"]["httpGet"] == {"path": ready, "port": "http"}
        assert container["livenessProbe"]["httpGet"] == {"path": HEALTH_PATH, "port": "http"}
        assert container["ports"] == [{"name": "http", "containerPort": DEFAULT_PORT, "protocol": "TCP"}]

    def budget(container):
        probe = container["startupProbe"]
        return probe["failureThreshold"] * probe["periodSeconds"]

    small = budget(native)
    big = budget(server(rendered(SEED).objects))  # 7B
    unknown = budget(server(rendered(SMOL, "model.name_or_path=/data/models/mine").objects))
    assert 300 <= small < big < 2 * 3600 and unknown == UNKNOWN_LOAD_S
    gaudi = budget(server(rendered(SEED, profile="gaudi", engine="vllm").objects))
    assert gaudi >= big + GAUDI_VLLM_WARMUP_S  # HPU graph warm-up
    deployment = one(rendered(SEED).objects, "Deployment")
    assert deployment["spec"]["progressDeadlineSeconds"] > big  # loading is not a stalled rollout


def test_model_size_from_the_name():
    assert model_params("meta-llama/Llama-2-7b-chat-hf") == 7_000_000_000
    assert model_params("smollm2-135m-instruct") == 135_000_000
    assert model_params("meta-llama/Llama-3.1-8B-Instruct") == 8_000_000_000
    assert model_params("Qwen/Qwen2.5-0.5B") == 500_000_000
    assert model_params("/data/models/mine") is None and model_params("gpt2") is None


@pytest.mark.parametrize("profile", PROFILES)
def test_guaranteed_qos_from_the_profile(profile):
    out = rendered(SEED, profile=profile, model_image="registry.example.com/run:1")
    pod = one(out.objects, "Deployment")["spec"]["template"]["spec"]
    for container in pod["containers"] + pod["initContainers"]:
        assert container["resources"]["requests"] == container["resources"]["limits"]
    limits = server(out.objects)["resources"]["limits"]
    if profile == "gaudi":
        assert limits["habana.ai/gaudi"] == "8" and "hugepages-2Mi" in limits and pod["hostIPC"] is True
    elif profile == "nvidia":
        assert limits["nvidia.com/gpu"] == "1"
    else:
        assert set(limits) == {"cpu", "memory"}


def test_cpu_profile_threads_and_vllm_kv_cache_from_the_limits():
    native = env_of(server(rendered(SMOL, "k8s.resources.cpu=7500m", "k8s.resources.memory=16Gi").objects))
    assert native["OMP_NUM_THREADS"] == "7" and "VLLM_CPU_KVCACHE_SPACE" not in native
    vllm = env_of(server(rendered(SMOL, "k8s.resources.memory=16Gi", engine="vllm").objects))
    assert vllm["OMP_NUM_THREADS"] == "8"
    assert vllm["VLLM_CPU_KVCACHE_SPACE"] == str(vllm_cpu_kvcache_gib(16 << 30, 135_000_000 * 2))
    unknown = rendered(SMOL, "model.name_or_path=/data/models/mine", "k8s.resources.memory=16Gi", engine="vllm")
    assert env_of(server(unknown.objects))["VLLM_CPU_KVCACHE_SPACE"] == str(vllm_cpu_kvcache_gib(16 << 30, 8 << 30))
    assert any("VLLM_CPU_KVCACHE_SPACE assumes" in w for w in unknown.warnings)
    gpu = env_of(server(rendered(SEED, profile="nvidia", engine="vllm").objects))
    assert "OMP_NUM_THREADS" not in gpu and "VLLM_CPU_KVCACHE_SPACE" not in gpu


def test_max_loras_reaches_either_engines_command():
    native = server(rendered(adapters=(Adapter("cardio", "runs/cardio"),), max_loras=2).objects)["command"]
    assert native[-2:] == ["--max-loras", "2"]
    vllm = rendered(SEED, profile="nvidia", engine="vllm", adapters=(Adapter("cardio", "runs/cardio"),), max_loras=1)
    command = server(vllm.objects)["command"]
    assert command[command.index("--max-loras") + 1] == "1"  # not the two adapters declared
    assert "--max-loras" not in server(rendered().objects)["command"]


def test_vllm_serves_a_lora_run_as_its_base_plus_the_runs_adapter():
    out = rendered(SEED, profile="nvidia", engine="vllm", adapters=(Adapter("cardio", "runs/cardio"),))
    container = server(out.objects)
    recipe = load_recipe(SEED, ["k8s.profile=nvidia"]).recipe
    run = r.cluster_recipe(recipe, r.Names.for_job(SEED, NS)).output_dir
    expected = vllm_argv(
        VllmOptions(
            model="meta-llama/Llama-2-7b-chat-hf",
            served_name="meta-llama/Llama-2-7b-chat-hf",
            adapters=(Adapter(SEED, f"{run}/adapter"), Adapter("cardio", "/data/runs/cardio/adapter")),
            host="0.0.0.0",
            port=DEFAULT_PORT,
            max_lora_rank=vllm_lora_rank(recipe.lora.r),
        )
    )
    assert container["command"] == ["python3", *expected[1:]]
    assert container["image"] == VLLM_IMAGES["nvidia"]
    assert {"name": "cache", "mountPath": "/cache"} in container["volumeMounts"]
    gaudi = server(rendered(SEED, profile="gaudi", engine="vllm").objects)
    assert gaudi["command"][gaudi["command"].index("--tensor-parallel-size") + 1] == "8"
    assert env_of(gaudi)["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "true" and gaudi["image"] == VLLM_IMAGES["gaudi"]
    assert server(rendered(SEED, engine="vllm", image="my/vllm:1").objects)["image"] == "my/vllm:1"


def test_vllm_loads_the_base_at_the_recipes_revision_with_its_own_code():
    """vLLM reads the model in its own process: what kubetune's loader passes (the recipe's
    revision and trust_remote_code) must reach vLLM's flags, or it loads another revision, or
    refuses the model's own code."""
    lora = server(
        rendered(SEED, "model.revision=v1", "model.trust_remote_code=true", profile="nvidia", engine="vllm").objects
    )["command"]
    assert lora[lora.index("--revision") + 1] == "v1" and "--trust-remote-code" in lora
    full = server(rendered(SEED, "finetune.method=full", "model.revision=v1", engine="vllm").objects)["command"]
    assert "--revision" not in full  # the trained model/ is a local directory, without revisions
    plain = server(rendered(SEED, profile="nvidia", engine="vllm").objects)["command"]
    assert "--revision" not in plain and "--trust-remote-code" not in plain


def test_vllm_over_the_embedded_gguf_serves_the_merged_export():
    out = rendered(engine="vllm")
    command = server(out.objects)["command"]
    assert command[command.index("--model") + 1] == f"/data/runs/{JOB}/merged"
    assert "--enable-lora" not in command
    (note,) = [w for w in out.warnings if "merged" in w]
    assert f"kubetune export /data/runs/{JOB} --merged" in note
    with pytest.raises(UserError, match=r"GGUF file; serve these adapters with --engine native"):
        rendered(engine="vllm", adapters=(Adapter("cardio", "runs/cardio"),))


def test_vllm_serves_a_full_fine_tune_from_its_model_directory():
    command = server(rendered(SEED, "finetune.method=full", engine="vllm").objects)["command"]
    assert command[command.index("--model") + 1].endswith("/model") and "--enable-lora" not in command


def test_a_pod_with_accelerators_serves_with_vllm_unless_told_otherwise(cli):
    # the native engine runs on CPUs: by default it would leave a Gaudi pod's cards idle
    for profile in ("gaudi", "nvidia"):
        out = rendered(SEED, profile=profile)
        container = server(out.objects)
        command = container["command"]
        assert container["image"] == VLLM_IMAGES[profile] and "vllm.entrypoints.openai.api_server" in command
        assert not [w for w in out.warnings if "idle" in w]
        asked = rendered(SEED, profile=profile, engine="native")
        assert server(asked.objects)["command"][:2] == ["kubetune", "serve"]
        assert any(w.startswith("--engine native runs on CPUs and leaves this") for w in asked.warnings)
    assert server(rendered(SEED).objects)["command"][:2] == ["kubetune", "serve"]  # cpu: the native engine
    result = cli("k8s", "render-serve", SEED, "--profile", "gaudi")
    assert result.code == 0 and f"image: {VLLM_IMAGES['gaudi']}" in result.out and "idle" not in result.err
    # the smollm2 recipes' 9 heads do not split over 8 cards: one line naming the fix, exit 2
    small = cli("k8s", "render-serve", SMOL, "--profile", "gaudi")
    assert small.code == 2 and small.err.count("\n") == 1 and "k8s.resources.accelerators" in small.err


def test_vllm_tensor_parallel_must_divide_the_heads():
    with pytest.raises(UserError, match=r"9 attention heads: set k8s\.resources\.accelerators"):
        rendered(SMOL, "model.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct", profile="gaudi", engine="vllm")


def test_grace_period_covers_the_drain():
    container = server(rendered().objects)
    pod = one(rendered().objects, "Deployment")["spec"]["template"]["spec"]
    sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > sleep + DRAIN_TIMEOUT_S


def test_service_ingress_and_disruption_budget():
    out = rendered(ingress_host="llm.example.com", ingress_class="nginx-internal")
    selector = one(out.objects, "Deployment")["spec"]["selector"]["matchLabels"]
    svc = one(out.objects, "Service")
    assert svc["spec"]["selector"] == selector
    assert svc["spec"]["ports"] == [{"name": "http", "port": DEFAULT_PORT, "targetPort": "http", "protocol": "TCP"}]
    ing = one(out.objects, "Ingress")
    notes = ing["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert int(notes["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    assert int(notes["nginx.ingress.kubernetes.io/proxy-send-timeout"]) >= 600
    assert ing["spec"]["ingressClassName"] == "nginx-internal"
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "llm.example.com"
    assert rule["http"]["paths"][0]["backend"] == {"service": {"name": SERVE, "port": {"name": "http"}}}
    pdb = one(out.objects, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"] == selector
    assert not any("no --ingress-host" in w for w in out.warnings)
    assert any("no --ingress-host" in w for w in rendered().warnings)


def test_autoscaler_on_the_waiting_queue_with_cpu_as_fallback():
    out = rendered(replicas=2, max_replicas=6, queue_target=3)
    hpa = one(out.objects, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": SERVE}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    queue, cpu = hpa["metrics"]
    assert queue["type"] == "Pods" and ":" not in queue["pods"]["metric"]["name"]
    assert queue["pods"]["target"] == {"type": "AverageValue", "averageValue": "3"}
    assert cpu["resource"] == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}}
    # the HPA owns the count: re-applying the Deployment must not reset it
    assert "replicas" not in one(out.objects, "Deployment")["spec"]
    # the adapter rule renames the series to what the HPA asks for
    data = one(out.objects, "ConfigMap")["data"]
    (rule,) = yaml.safe_load(data["rules.yaml"])["rules"]
    assert yaml.safe_load(data["helm-values.yaml"])["rules"]["custom"] == [rule]
    assert rule["seriesQuery"].startswith(WAITING_METRIC + "{")
    assert rule["name"]["as"] == queue["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    template = one(out.objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert template["prometheus.io/scrape"] == "true" and template["prometheus.io/port"] == str(DEFAULT_PORT)

    cpu_only = rendered(autoscale="cpu").objects
    assert [m["type"] for m in one(cpu_only, "HorizontalPodAutoscaler")["spec"]["metrics"]] == ["Resource"]
    assert not [o for o in cpu_only if o["kind"] == "ConfigMap"]
    fixed = rendered(replicas=3, autoscale="off").objects
    assert not [o for o in fixed if o["kind"] == "HorizontalPodAutoscaler"]
    assert one(fixed, "Deployment")["spec"]["replicas"] == 3


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("engine", ENGINES)
def test_every_object_validates_strictly(profile, engine):
    out = rendered(SEED, profile=profile, engine=engine, token=TOKEN, ingress_host="llm.example.com")
    assert validate_objects(out.objects) == []
    image = rendered(SEED, profile=profile, engine=engine, model_image="registry.example.com/run:1", autoscale="off")
    assert validate_objects(image.objects) == []


@pytest.mark.parametrize(
    "name,recipe,profile,engine",
    [("serve-cpu-native.yaml", SMOL, "cpu", "native"), ("serve-nvidia-vllm.yaml", SEED, "nvidia", "vllm")],
)
def test_snapshot(name, recipe, profile, engine):
    # the vLLM one with an API key and cert-manager's TLS, the native one open (the defaults)
    access = {"api_key_secret": "llm-keys", "cert_manager_issuer": "letsencrypt"} if engine == "vllm" else {}
    objects = rendered(recipe, profile=profile, engine=engine, ingress_host="llm.example.com", **access).objects
    # all that render-serve makes (the output omits the Namespace and the ServiceMonitor)
    text = r.to_yaml(objects, create_namespace=True, prometheus_operator=True)
    path = SNAPSHOTS / name
    if os.environ.get("KUBETUNE_UPDATE_SNAPSHOTS"):
        path.write_text(text)
    assert path.is_file(), f"missing snapshot {path.name}: run with KUBETUNE_UPDATE_SNAPSHOTS=1"
    assert text == path.read_text(), f"render-serve changed; if intended, regenerate {path.name} (see module docstring)"


def test_a_local_run_directory(tmp_path):
    run_dir = tmp_path / "cardio-lora"
    run = RunDir(run_dir)
    run.write_record(load_recipe(SMOL, [f"output_dir={run_dir}"]).recipe, "finished")
    with pytest.raises(UserError, match=r"has no adapter/ yet"):
        load_source(str(run_dir), [])  # an unfinished run: nothing to serve
    (run_dir / "adapter").mkdir()
    recipe, local = load_source(str(run_dir), ["k8s.namespace=team"])
    assert local == run_dir
    out = render_serve(recipe, ServeSettings(), local_run=local)
    assert server(out.objects)["command"][2] == "/data/runs/cardio-lora" and out.names.job == "cardio-lora-serve"
    (note,) = [w for w in out.warnings if "local run" in w]
    assert f"kubectl cp {run_dir} team/cardio-lora-data:/data/runs/cardio-lora" in note


# ------------------------------------------------------------------------------ access and placement

KEY_SECRET = "llm-keys"
API_KEY_VALUE = "sk-never-in-a-manifest-0123456789"


@pytest.mark.parametrize(
    ("engine", "variable", "probe"), [("native", "KUBETUNE_API_KEY", READY_PATH), ("vllm", "VLLM_API_KEY", HEALTH_PATH)]
)
def test_the_api_key_comes_from_the_named_secret(engine, variable, probe):
    """Required (not optional): without its Secret a pod does not start rather than serve openly.
    vLLM's /v1/models needs the key once one is set, so its probes ask /health."""
    container = server(rendered(engine=engine, api_key_secret=KEY_SECRET).objects)
    ref = {"secretKeyRef": {"name": KEY_SECRET, "key": API_KEY_SECRET_KEY}}
    assert env_of(container)[variable] == ref
    assert container["readinessProbe"]["httpGet"]["path"] == probe
    assert container["startupProbe"]["httpGet"]["path"] == probe
    assert not [e for e in server(rendered(engine=engine).objects)["env"] if "API_KEY" in e["name"]]


def test_the_key_itself_is_never_rendered(cli, tmp_path, monkeypatch):
    """Not even when the shell that renders holds it (as the server's own variables)."""
    monkeypatch.setenv("KUBETUNE_API_KEY", API_KEY_VALUE)
    monkeypatch.setenv("VLLM_API_KEY", API_KEY_VALUE)
    out = tmp_path / "serve"
    for extra in ([], ["--engine", "vllm"]):
        result = cli("k8s", "render-serve", SEED, "--api-key-secret", KEY_SECRET, *extra, "-o", str(out))
        assert result.code == 0, result.err
        assert f"kubectl create secret generic {KEY_SECRET} -n {NS} --from-literal=api-key=" in result.err
        printed = cli("k8s", "render-serve", SEED, "--api-key-secret", KEY_SECRET, *extra)
        written = "".join(p.read_text() for p in out.iterdir())
        assert KEY_SECRET in written and KEY_SECRET in printed.out
        assert API_KEY_VALUE not in written + printed.out + printed.err + result.err


def test_network_policy_lets_in_the_namespace_the_ingress_controller_and_prometheus_only():
    out = rendered(ingress_namespace="traefik", monitoring_namespace="observability")
    policy = one(out.objects, "NetworkPolicy")
    pod_labels = one(out.objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    spec = policy["spec"]
    assert policy["metadata"]["name"] == SERVE
    assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["policyTypes"] == ["Ingress"]  # egress open: a hub base model is downloaded at start
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    namespaces = [p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in rule["from"][1:]]
    assert rule["from"][0] == {"podSelector": {}} and namespaces == ["traefik", "observability"]
    defaults = one(rendered().objects, "NetworkPolicy")["spec"]["ingress"][0]["from"]
    assert [p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in defaults[1:]] == [
        "ingress-nginx",
        "monitoring",
    ]
    assert not [o for o in rendered(network_policy=False).objects if o["kind"] == "NetworkPolicy"]


def test_ingress_tls_from_a_secret_or_from_cert_manager():
    host = "llm.example.com"
    plain = one(rendered(ingress_host=host).objects, "Ingress")
    assert "tls" not in plain["spec"] and "cert-manager.io/cluster-issuer" not in plain["metadata"]["annotations"]
    given = one(rendered(ingress_host=host, ingress_tls_secret="llm-cert").objects, "Ingress")
    assert given["spec"]["tls"] == [{"hosts": [host], "secretName": "llm-cert"}]
    assert "cert-manager.io/cluster-issuer" not in given["metadata"]["annotations"]
    issued = one(rendered(ingress_host=host, cert_manager_issuer="letsencrypt").objects, "Ingress")
    assert issued["spec"]["tls"] == [{"hosts": [host], "secretName": f"{SERVE}-tls"}]
    assert issued["metadata"]["annotations"]["cert-manager.io/cluster-issuer"] == "letsencrypt"
    with pytest.raises(RecipeError, match="give --ingress-host too"):
        rendered(cert_manager_issuer="letsencrypt")


def test_the_ingress_allows_the_bodies_the_server_accepts():
    notes = one(rendered().objects, "Ingress")["metadata"]["annotations"]
    assert notes["nginx.ingress.kubernetes.io/proxy-body-size"] == nginx_size(DEFAULT_MAX_BODY_BYTES) == "2m"
    assert (nginx_size(3 << 19), nginx_size(1000)) == ("1536k", "1000")


def test_the_cpu_feature_label_is_preferred_unless_required():
    label = load_recipe(SMOL).recipe.k8s.amx_label
    term = {"matchExpressions": [{"key": label, "operator": "In", "values": ["true"]}]}

    def node_affinity(**settings):
        pod = one(rendered(**settings).objects, "Deployment")["spec"]["template"]["spec"]
        return pod.get("affinity", {}).get("nodeAffinity")

    assert node_affinity() == {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": term}]}
    required = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    assert node_affinity(require_cpu_features=True) == required
    assert node_affinity(profile="nvidia") is None


def test_access_warnings():
    host = "llm.example.com"
    assert any("no --api-key-secret" in w for w in rendered(ingress_host=host).warnings)
    keyed = rendered(ingress_host=host, api_key_secret=KEY_SECRET).warnings
    assert any("in clear text" in w for w in keyed) and not any("no --api-key-secret" in w for w in keyed)
    safe = rendered(ingress_host=host, api_key_secret=KEY_SECRET, ingress_tls_secret="llm-cert").warnings
    assert not any("clear text" in w or "api-key" in w for w in safe)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("engine", ENGINES)
def test_the_access_objects_validate_strictly(profile, engine):
    access = {"api_key_secret": KEY_SECRET, "ingress_host": "llm.example.com"}
    for tls in ({"ingress_tls_secret": "llm-cert"}, {"cert_manager_issuer": "letsencrypt"}):
        out = rendered(SEED, profile=profile, engine=engine, require_cpu_features=True, **access, **tls)
        assert validate_objects(out.objects) == []
        assert [o for o in out.objects if o["kind"] == "NetworkPolicy"]


# ------------------------------------------------------------------------------ the command


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)


def test_cli_writes_one_file_per_object_for_kustomize(cli, tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    out = tmp_path / "serve"
    result = cli(
        "k8s", "render-serve", SMOL, "--profile", "cpu", "--hf-token-file", str(token), "--check", "-o", str(out)
    )
    assert result.code == 0, result.err
    assert result.out == "" and "checked 10 objects: all valid" in result.err
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        [  # no Namespace: `kubectl delete -k` of this directory must not delete it
            f"secret-{JOB}-hf-token.yaml",  # the training job's Secret, which the pods read
            f"networkpolicy-{SERVE}.yaml",
            f"configmap-{SERVE}-prometheus-adapter-rule.yaml",
            f"deployment-{SERVE}.yaml",
            f"service-{SERVE}.yaml",
            f"poddisruptionbudget-{SERVE}.yaml",
            f"servicemonitor-{SERVE}.yaml",
            f"horizontalpodautoscaler-{SERVE}.yaml",
            f"ingress-{SERVE}.yaml",
            "kustomization.yaml",
        ]
    )
    assert (out / f"secret-{JOB}-hf-token.yaml").stat().st_mode & 0o077 == 0
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: cannot run `kubectl kustomize`")
    built = subprocess.run(["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr


def test_cli_stdout_redacts_the_token_and_warns_on_stderr(cli, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    result = cli("k8s", "render-serve", SMOL, "--adapter", "x=y")
    assert result.code == 0, result.err
    assert TOKEN not in result.out + result.err and f"# Secret {JOB}-hf-token: not printed" in result.out
    docs = [d for d in yaml.safe_load_all(result.out) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["command"][-2:] == ["--adapter", "x=/data/y"]
    assert "warning: no --ingress-host" in result.err


@pytest.mark.parametrize(
    "args,message",
    [
        ([], "give a run: `kubetune k8s render-serve RUN_DIR|RECIPE"),
        (["k8s.replicas=2"], "must be a run directory or a recipe, not the override"),
        (["nope"], "recipe file not found: nope"),
        ([SMOL, "--profile", "tpu"], "`k8s.profile`: got 'tpu'"),
        ([SMOL, "--engine", "auto"], "--engine auto: use native or vllm"),
        ([SMOL, "--autoscale", "memory"], "--autoscale memory: use queue, cpu or off"),
        ([SMOL, "--adapter", "cardio"], "--adapter 'cardio': expected NAME=RUN_DIR"),
        ([SMOL, "--adapter", "a=x", "--adapter", "a=y"], "--adapter names must be unique (repeated: a)"),
        ([SMOL, "--max-loras", "0"], "--max-loras 0"),
        ([SMOL, "--min-replicas", "3", "--max-replicas", "2"], "--max-replicas 2 is below --min-replicas 3"),
        ([SMOL, "--replicas", "0"], "--replicas/--min-replicas must be at least 1"),
        ([SMOL, "--name", "9lives"], "--name '9lives': a Service name is a DNS-1035 label"),
        ([SMOL, "--ingress-host", "http://x"], "--ingress-host 'http://x': a DNS name"),
        ([SMOL, "--ingress-tls-secret", "cert"], "a certificate is for a host; give --ingress-host too"),
        ([SMOL, "--api-key-secret", "Keys_1"], "--api-key-secret 'Keys_1': a Secret name is lower-case"),
        ([SMOL, "--ingress-namespace", "a.b"], "--ingress-namespace 'a.b': a namespace is lower-case"),
        ([SMOL, "k8s.resources.cpu=0"], "k8s.resources.cpu must be more than 0"),
        ([SMOL, "--profile", "gaudi", "k8s.resources.accelerators=0"], "the gaudi profile needs"),
        (["/"], "/ is not a kubetune run directory (no recipe.yaml)"),
    ],
)
def test_bad_input_is_exit_2_with_one_line(cli, args, message):
    result = cli("k8s", "render-serve", *args)
    assert result.code == 2, result.err
    assert result.out == ""
    assert result.err.count("\n") == 1 and message in result.err, result.err


# ------------------------------------------------------------------------------ submit / status / delete


def _serve_pod(name, ready=True, phase="Running"):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app.kubernetes.io/instance": SERVE, "app.kubernetes.io/component": "server"},
        },
        "spec": {"containers": [{"name": "server", "image": "img"}], "nodeName": "xeon-a"},
        "status": {"phase": phase, "containerStatuses": [{"name": "server", "ready": ready, "restartCount": 0}]},
    }


def test_submit_applies_the_serving_objects_in_order():
    fake = FakeClient()
    lines = follow.submit(fake, rendered())
    assert lines[0] == "created Namespace kubetune"
    assert [c[1] for c in fake.calls if c[0] == "create"] == [
        "Namespace",
        "NetworkPolicy",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "HorizontalPodAutoscaler",
        "Ingress",
    ]
    assert {line.split()[0] for line in follow.submit(fake, rendered())} == {"unchanged"}


def test_status_shows_the_deployments_ready_replicas_autoscaler_and_endpoint():
    fake = FakeClient()
    follow.submit(fake, rendered(ingress_host="llm.example.com"))
    deployment = fake.get("apps/v1", "Deployment", SERVE, NS)
    fake._put(
        dict(deployment, status={"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2, "availableReplicas": 1})
    )
    hpa = fake.get("autoscaling/v2", "HorizontalPodAutoscaler", SERVE, NS)
    cpu_only = [{"type": "Resource", "resource": {"name": "cpu", "current": {"averageUtilization": 35}}}]
    fake._put(dict(hpa, status={"currentReplicas": 2, "desiredReplicas": 2, "currentMetrics": cpu_only}))
    fake._put(_serve_pod(f"{SERVE}-7d9f-abcde"))
    fake._put(_serve_pod(f"{SERVE}-7d9f-fghij", ready=False))
    st = follow.status(fake, SERVE, NS)
    assert st.job is None and st.deployment is not None
    assert st.lines[0] == f"Deployment {NS}/{SERVE}: 1/2 ready (2 up to date, 1 available)"
    assert st.lines[1] == "autoscaler: 2 replicas, wants 2 (1..4); now cpu 35%"
    assert "the waiting-queue metric is not readable" in st.lines[2] and "scales up on CPU only" in st.lines[2]
    rows = [line.split()[:3] for line in st.lines if line.startswith(SERVE)]
    assert rows == [[f"{SERVE}-7d9f-abcde", "Running", "yes"], [f"{SERVE}-7d9f-fghij", "Running", "no"]]
    assert st.lines[-1] == (
        f"endpoint: http://llm.example.com/v1 (Ingress), http://{SERVE}.{NS}.svc:8000/v1 in the cluster"
    )
    with pytest.raises(UserError, match="no PyTorchJob or TrainJob named"):
        follow.status(fake, "nothing-here", NS)


def test_delete_removes_the_serving_objects_by_label_and_leaves_the_jobs():
    fake = FakeClient()
    follow.submit(fake, r.render(load_recipe(SMOL).recipe))
    follow.submit(fake, rendered(token=TOKEN))
    lines = follow.delete(fake, SERVE, NS)
    gone = {line.split()[1] for line in lines}
    assert gone == {
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Ingress",
        "NetworkPolicy",
        "Service",
        "ConfigMap",
        "ServiceMonitor",
    }, lines
    assert fake.get("v1", "Secret", f"{JOB}-hf-token", NS) is not None  # the job's token: the job's to delete
    assert not any("kept the PVC" in line for line in lines)  # serving has no PVC of its own
    assert fake.get("kubeflow.org/v1", "PyTorchJob", JOB, NS) is not None  # the job stays
    assert fake.get("v1", "ConfigMap", f"{JOB}-recipe", NS) is not None
    assert follow.delete(fake, SERVE, NS) == [f"nothing named {SERVE} in namespace {NS}"]


def test_submit_status_delete_through_the_cli_and_the_api_server(cli, kube, tmp_path):
    result = cli("k8s", "submit", "--serve", SMOL, "--replicas", "2", "--ingress-host", "llm.example.com")
    assert result.code == 0, result.err
    assert f"created Deployment {NS}/{SERVE}" in result.out and f"kubetune k8s status {SERVE}" in result.out
    assert list(kube.objects("apps/v1/deployments")) == [(NS, SERVE)]
    for plural in (
        "v1/services",
        "networking.k8s.io/v1/ingresses",
        "networking.k8s.io/v1/networkpolicies",
        "policy/v1/poddisruptionbudgets",
    ):
        assert list(kube.objects(plural)) == [(NS, SERVE)], plural
    assert kube.objects("autoscaling/v2/horizontalpodautoscalers")[(NS, SERVE)]["spec"]["minReplicas"] == 2
    again = cli("k8s", "submit", "--serve", SMOL, "--replicas", "2", "--ingress-host", "llm.example.com")
    assert {line.split()[0] for line in again.out.splitlines() if not line.startswith("follow")} == {"unchanged"}

    kube.client().create(_serve_pod(f"{SERVE}-abc-12345"))
    status = cli("k8s", "status", SERVE)
    assert status.code == 0, status.err
    assert status.out.splitlines()[0].startswith(f"Deployment {NS}/{SERVE}: 0/")
    assert f"{SERVE}-abc-12345" in status.out and "http://llm.example.com/v1" in status.out

    deleted = cli("k8s", "delete", SERVE)
    assert deleted.code == 0, deleted.err
    assert f"deleted Deployment {NS}/{SERVE}" in deleted.out
    for plural in ("apps/v1/deployments", "v1/services", "autoscaling/v2/horizontalpodautoscalers", "v1/configmaps"):
        assert kube.objects(plural) == {}, plural


def test_submit_refuses_serving_options_without_serve(cli):
    result = cli("k8s", "submit", SMOL, "--engine", "vllm", "--replicas", "2")
    assert result.code == 2 and "--engine, --replicas: serving options" in result.err
    result = cli("k8s", "submit", "--serve", SMOL, "--api", "trainjob")
    assert result.code == 2 and "--api and --with-runtime are options of a training job" in result.err


def test_every_setting_is_an_option_of_render_serve_and_submit():
    """A ServeSettings field is a flag of both commands with nothing else written for it."""
    import typer.main

    from kubetune.cli import app

    k8s = typer.main.get_command(app).commands["k8s"]
    flags = [option.flag for _, option in setting_options()]
    for name in ("render-serve", "submit"):
        taken = {opt for param in k8s.commands[name].params for opt in param.opts}
        assert set(flags) <= taken, name


def test_flags_as_given_become_settings_and_a_switch_turns_its_default():
    given = {"replicas": 0, "adapters": ["cardio=runs/cardio"], "network_policy": True, "require_cpu_features": False}
    assert ServeSettings.from_flags(given) == ServeSettings(
        replicas=0, adapters=(Adapter("cardio", "runs/cardio"),), network_policy=False
    )
    assert flags_given(given) == ["--replicas", "--adapter", "--no-network-policy"]  # 0 is given, a switch off is not
    assert spec_given({"engine": "vllm", "ingress_host": "llm.example.com", "name": "x"}) == {
        "engine": "vllm",
        "ingressHost": "llm.example.com",
    }
