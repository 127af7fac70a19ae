"""The operator's decisions without kopf or a cluster: plan.py, metrics_page.py, k8s/export_job.py."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

import kubernetes_validate
import pytest

from kubetune.contracts.metrics import TRAIN_METRICS
from kubetune.errors import RecipeError
from kubetune.k8s.export_job import export_job
from kubetune.k8s.names import Names
from kubetune.k8s.objects import recipe_text_data
from kubetune.k8s.progress import Progress
from kubetune.k8s.render import render
from kubetune.k8s.serve import ServeSettings
from kubetune.operator import metrics_page, plan
from kubetune.operator.crd import serve_schema
from kubetune.rundir import changed_keys

OWNER = {"metadata": {"name": "ft", "namespace": "team", "uid": "u-1"}}
BASE = plan.Observed(
    suspend=False, trained=False, failed_before=False, job_exists=True, job_state="Running",
    export_wanted=True, export_state=None, serve_enabled=True, serving=False,
)  # fmt: skip


def observed(**changes) -> plan.Observed:
    return dataclasses.replace(BASE, **changes)


def recipe(data: dict | None = None, **spec):
    return plan.resolved(plan.load_recipe_for("ft", "team", data or {}, plan.FineTuneSpec(**spec)))


# ------------------------------------------------------------------ next step


@pytest.mark.parametrize(
    ("changes", "phase", "actions"),
    [
        ({"job_exists": False, "job_state": None}, "Pending", ("create-training",)),
        ({"job_state": "Created"}, "Pending", ()),
        ({}, "Running", ()),
        ({"job_state": "Restarting"}, "Running", ()),
        ({"suspend": True}, "Suspended", ("delete-training",)),
        ({"suspend": True, "job_exists": False, "job_state": None}, "Suspended", ()),
        ({"job_state": "Failed"}, "Failed", ()),
        ({"failed_before": True, "job_exists": False, "job_state": None}, "Failed", ()),  # not recreated
        ({"failed_before": True, "suspend": True}, "Suspended", ("delete-training",)),  # how to retry
        ({"job_state": "Succeeded"}, "Exporting", ("create-export",)),
        ({"job_state": "Complete"}, "Exporting", ("create-export",)),  # TrainJob's word
        ({"trained": True, "job_exists": False, "export_state": "Running"}, "Exporting", ()),
        ({"trained": True, "export_state": "Failed"}, "Failed", ()),
        ({"trained": True, "export_state": "Complete"}, "Serving", ("create-serving",)),
        ({"trained": True, "export_state": "Complete", "serving": True}, "Serving", ()),
        ({"trained": True, "export_wanted": False, "serve_enabled": False}, "Succeeded", ()),
        ({"trained": True, "suspend": True, "export_state": "Complete", "serving": True}, "Serving", ()),
    ],
)
def test_next_step(changes, phase, actions):
    assert plan.next_step(observed(**changes)) == plan.Step(phase, actions)


def test_job_and_export_states_and_ttl():
    job = {"status": {"conditions": [
        {"type": "Created", "status": "True"},
        {"type": "Running", "status": "False"},
        {"type": "Succeeded", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
    ]}}  # fmt: skip
    assert plan.job_state(job) == "Succeeded" and plan.job_state(None) is None
    now = datetime(2026, 1, 1, 0, 10, tzinfo=timezone.utc)
    assert plan.ttl_expired(job, 600, now) and not plan.ttl_expired(job, 601, now)
    assert not plan.ttl_expired(job, None, now) and not plan.ttl_expired({"status": {}}, 0, now)
    assert plan.export_state({"status": {"succeeded": 1}}) == "Complete"
    assert plan.export_state({"status": {"conditions": [{"type": "Failed", "status": "True"}]}}) == "Failed"
    assert plan.export_state({"status": {"active": 1}}) == "Running" and plan.export_state(None) is None


# ------------------------------------------------------------------ the recipe


def test_the_finetune_names_and_places_the_job_and_spec_overrides_profile_and_api():
    r = recipe({"k8s": {"profile": "cpu"}}, profile="nvidia", api="trainjob")
    assert (r.k8s.name, r.k8s.namespace, r.k8s.profile, r.k8s.api) == ("ft", "team", "nvidia", "trainjob")
    assert r.output_dir == "/data/runs/ft"  # on the claim, as the ConfigMap holds it


def test_every_problem_is_one_line():
    tgi = plan.ServeSpec.from_dict({"enabled": True, "engine": "tgi"})
    with pytest.raises(RecipeError) as e:
        recipe({"k8s": {"name": "other", "replicas": 0}, "train": {"lr": -1}}, serve=tgi)
    assert e.value.problems[0].startswith("`k8s.name`: a FineTune's objects are named and placed by the FineTune")
    assert any(p.startswith("`k8s.replicas`") for p in e.value.problems)
    assert any(p.startswith("`train.lr`") for p in e.value.problems)
    assert all("\n" not in p for p in e.value.problems)
    with pytest.raises(RecipeError, match=r"spec.serve: engine tgi: use native or vllm"):
        recipe({}, serve=tgi)


def test_spec_serve_holds_the_settings_that_name_a_spec_key_and_the_crd_declares_them():
    spec = {"enabled": True, "engine": "vllm", "replicas": 3, "minReplicas": 2, "maxReplicas": 6}
    spec |= {"image": "my/server:1", "ingressHost": "llm.example.com", "autoscale": "cpu"}
    serve = plan.ServeSpec.from_dict(spec)
    assert serve == plan.ServeSpec(
        True,
        ServeSettings(
            engine="vllm",
            replicas=3,
            min_replicas=2,
            max_replicas=6,
            image="my/server:1",
            ingress_host="llm.example.com",
            autoscale="cpu",
        ),
    )
    assert plan.ServeSpec.from_dict({}) == plan.ServeSpec(False, ServeSettings())
    shared = plan.ServeSpec.from_dict({"server": "llama", "adapterName": "cardio"})
    assert (shared.server, shared.adapter_name) == ("llama", "cardio")
    assert set(serve_schema()["properties"]) == set(spec) | {"server", "adapterName"}


def test_recipe_text_errors_are_one_line():
    with pytest.raises(RecipeError, match=r"^ConfigMap x: not valid YAML"):
        recipe_text_data("a: [", "ConfigMap x")
    with pytest.raises(RecipeError, match="a recipe is a YAML mapping"):
        recipe_text_data("- a", "ConfigMap x")


def test_changed_keys_split_resumable_from_learned():
    running = recipe({"train": {"max_steps": 10}})
    longer = recipe({"train": {"max_steps": 20, "save_every": 5}, "k8s": {"replicas": 4}})
    assert changed_keys(running, longer) == (["k8s.replicas", "train.max_steps", "train.save_every"], [])
    other = recipe({"train": {"max_steps": 10, "lr": 1e-3}, "lora": {"r": 4}})
    assert changed_keys(running, other) == ([], ["lora.r", "train.lr"])
    assert changed_keys(running, running) == ([], [])


# ------------------------------------------------------------------ ownership


def test_owned_objects_skip_the_namespace_and_keep_the_claim_unless_asked():
    objects = render(recipe({"k8s": {"priority_class": "high", "priority_value": 100}})).objects
    kinds = {o["kind"]: o for o in plan.owned(objects, OWNER, delete_claim=False)}
    assert "Namespace" not in kinds
    assert "ownerReferences" not in kinds["PersistentVolumeClaim"]["metadata"]
    assert "ownerReferences" not in kinds["PriorityClass"]["metadata"]  # cluster-scoped
    ref = kinds["PyTorchJob"]["metadata"]["ownerReferences"]
    assert ref == [{"apiVersion": "kubetune.io/v1alpha1", "kind": "FineTune", "name": "ft", "uid": "u-1",
                    "controller": True, "blockOwnerDeletion": True}]  # fmt: skip
    deleted = {o["kind"]: o for o in plan.owned(objects, OWNER, delete_claim=True)}
    assert deleted["PersistentVolumeClaim"]["metadata"]["ownerReferences"] == ref
    assert all("ownerReferences" not in o["metadata"] for o in objects)  # the renderer's objects are untouched


# ------------------------------------------------------------------ status


def test_progress_status_and_conditions():
    p = Progress(step=30, total_steps=120, loss=1.5, tokens_per_s=850.0, eta_s=3725.0)
    assert plan.progress_status(p, eval_loss=1.7) == {
        "step": 30, "totalSteps": 120, "percent": 25, "loss": 1.5, "evalLoss": 1.7,
        "tokensPerSecond": 850.0, "etaSeconds": 3725, "eta": "1h2m5s",
    }  # fmt: skip
    done = plan.progress_status(Progress(step=120, total_steps=120, loss=float("nan")))
    assert done == {"step": 120, "totalSteps": 120, "percent": 100, "etaSeconds": 0, "eta": "done"}
    first = plan.with_condition([], plan.condition("Training", True, "Running"), "t1")
    same = plan.with_condition(first, plan.condition("Training", True, "Running", "again"), "t2")
    flipped = plan.with_condition(same, plan.condition("Training", False, "Succeeded"), "t3")
    assert [c["lastTransitionTime"] for c in (*first, *same, *flipped)] == ["t1", "t1", "t3"]
    assert same[0]["message"] == "again"


def test_endpoint_prefers_the_ingress_host():
    meta = {"name": "ft-serve", "namespace": "team"}
    service = {"kind": "Service", "metadata": meta, "spec": {"ports": [{"port": 8000}]}}
    ingress = {"kind": "Ingress", "spec": {"rules": [{"host": "llm.example.com"}]}}
    assert plan.endpoint([service]) == "http://ft-serve.team.svc:8000/v1"
    assert plan.endpoint([ingress, service]) == "http://llm.example.com/v1"
    assert plan.endpoint([]) is None


# ------------------------------------------------------------------ metrics and the export Job


def test_metrics_names_are_the_contracts():
    names = {m.name for m in TRAIN_METRICS}
    assert set(metrics_page.USED) <= names


def test_progress_from_the_metrics_page_takes_rank_0():
    page = "\n".join([
        "# HELP kubetune_train_step Optimizer steps done.",
        "# TYPE kubetune_train_step gauge",
        'kubetune_train_step{job="ft",node="n1",rank="1"} 99.0',
        'kubetune_train_step{job="ft",node="n0",rank="0"} 42.0',
        'kubetune_train_total_steps{job="ft",node="n0",rank="0"} 100.0',
        'kubetune_train_loss{job="ft",node="n0",rank="0"} 1.25',
        'kubetune_train_eval_loss{job="ft",node="n0",rank="0"} 1.5',
        'kubetune_train_eta_seconds{job="ft",node="n0",rank="0"} 58.0',
        'kubetune_train_tokens_per_second{job="ft",node="n0",rank="0"} 900.5',
    ])  # fmt: skip
    p, eval_loss = metrics_page.from_metrics_text(page)
    assert (p.step, p.total_steps, p.loss, p.eta_s, p.tokens_per_s, eval_loss) == (42, 100, 1.25, 58.0, 900.5, 1.5)
    assert metrics_page.from_metrics_text("kubetune_train_step 3\n") == (None, None)  # no total yet


def test_progress_from_a_page_without_rank_0_takes_its_lowest_rank():
    # seed 002's Workers: c10d may give worker-0 (the pod read) ranks 4..7; every rank holds the step and loss
    page = "\n".join(
        f'kubetune_train_{name}{{job="ft",node="n1",rank="{rank}"}} {value}'
        for rank in (5, 4)
        for name, value in (("step", 42.0), ("total_steps", 100.0), ("loss", 1.25 + rank))
    )
    p, _ = metrics_page.from_metrics_text(page)
    assert (p.step, p.total_steps, p.loss, p.source) == (42, 100, 5.25, "rank-4 metrics")


def test_a_page_that_is_not_prometheus_text_has_no_progress():
    # whatever else answers on the port (an HTML error page): the status falls back to the log
    assert metrics_page.from_metrics_text("<html><body>502 Bad Gateway</body></html>") == (None, None)


def test_metrics_url_needs_the_named_port_and_an_ip():
    ports = [{"name": "metrics", "containerPort": 9450}]
    pod = {"spec": {"containers": [{"ports": ports}]}, "status": {"podIP": "10.0.0.7"}}
    assert metrics_page.metrics_url(pod) == "http://10.0.0.7:9450/metrics"
    assert metrics_page.metrics_url({**pod, "status": {}}) is None


def test_export_job_runs_the_merged_export_on_the_claim_and_validates():
    r = recipe({"k8s": {"image": "registry.example/kubetune:1"}})
    job = export_job(r, Names.for_job("ft", "team"), "ft-export")
    kubernetes_validate.validate(job, "1.35.0", strict=True)
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["kubetune", "export", "/data/runs/ft", "--merged"]
    assert container["image"] == "registry.example/kubetune:1"
    assert pod["volumes"] == [{"name": "data", "persistentVolumeClaim": {"claimName": "ft-data"}}]
    assert pod["restartPolicy"] == "Never"
    gaudi = export_job(recipe(profile="gaudi"), Names.for_job("ft", "team"), "x")["spec"]["template"]["spec"]
    assert set(gaudi["containers"][0]["resources"]["limits"]) == {"cpu", "memory"}  # merging needs no card


def test_a_base_model_with_the_chat_template_is_refused_as_render_refuses_it():
    data = {"model": {"name_or_path": "meta-llama/Llama-2-7b-hf"}, "data": {"template": "chat"}}
    with pytest.raises(RecipeError, match=r"data\.template=chat: the tokenizer of model\.name_or_path=meta-llama"):
        recipe(data)
    assert recipe({**data, "data": {"template": "alpaca"}}).model.name_or_path == "meta-llama/Llama-2-7b-hf"
