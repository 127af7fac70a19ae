"""`kubetune k8s render` of a GRPO recipe with finetune.rl.rollout=server: the rollout server's
Deployment and Service beside the job, on the job's claim, and the job's recipe pointing at it."""

from __future__ import annotations

import pytest
import yaml

from kubetune.contracts.serving import DEFAULT_PORT, ROLLOUT_WAIT_ENV
from kubetune.k8s import profiles
from kubetune.k8s import render as r
from kubetune.k8s.validate import validate_objects
from kubetune.recipe.loader import load_recipe

PROFILES = ("cpu", "gaudi", "nvidia")
SMOL = "smollm2-135m-lora-cpu"
JOB, NS = SMOL, "kubetune"
ROLLOUT = f"{JOB}-rollout"
URL = f"http://{ROLLOUT}.{NS}.svc:{DEFAULT_PORT}"
GRPO = [
    "finetune.objective=grpo",
    "finetune.rl.rollout=server",
    "data.train=builtin:arithmetic_train",
    "train.micro_batch_size=8",
    "train.grad_accum=1",
    "train.global_batch_size=null",
]


def rendered(profile="cpu", *overrides):
    return r.render(load_recipe(SMOL, [f"k8s.profile={profile}", *GRPO, *overrides]).recipe)


def named(objects, kind, name):
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def job_recipe(objects):
    config_map = named(objects, "ConfigMap", f"{JOB}-recipe")
    return yaml.safe_load(next(iter(config_map["data"].values())))


@pytest.mark.parametrize("profile", PROFILES)
def test_the_rollout_server_sits_beside_the_job_and_validates(profile):
    out = rendered(profile)
    assert validate_objects(out.objects) == []
    kinds = [(o["kind"], o["metadata"]["name"]) for o in out.objects]
    assert kinds.index(("Deployment", ROLLOUT)) < kinds.index(("Service", ROLLOUT)) < len(kinds) - 1  # the job last
    assert job_recipe(out.objects)["finetune"]["rl"]["server_url"] == URL
    pod = named(out.objects, "Deployment", ROLLOUT)["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    assert server["command"][:3] == ["kubetune", "serve", load_recipe(SMOL, []).recipe.model.name_or_path]
    assert "--allow-runtime-adapters" in server["command"] and "native" in server["command"]
    # the job's claim, read-only, at the path the trainer writes its adapters under
    claim = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
    assert claim["persistentVolumeClaim"]["claimName"] == f"{JOB}-data"
    mount = next(m for m in server["volumeMounts"] if m["name"] == claim["name"])
    assert mount == {"name": claim["name"], "mountPath": "/data", "readOnly": True}
    assert job_recipe(out.objects)["output_dir"].startswith("/data/")
    assert {e["name"]: e["value"] for e in server["env"] if "value" in e}["HF_HOME"] == "/cache/hf"  # not the claim
    card = profiles.PROFILES[profile].accelerator_resource
    assert card is None or card not in server["resources"]["limits"]  # the native engine samples on CPUs
    service = named(out.objects, "Service", ROLLOUT)
    assert service["spec"]["selector"] == named(out.objects, "Deployment", ROLLOUT)["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["port"] == DEFAULT_PORT
    workers = yaml.safe_dump(out.job)
    assert ROLLOUT_WAIT_ENV in workers  # the trainer waits for a server that is still loading its model


def test_a_server_elsewhere_is_used_as_it_is():
    out = rendered("cpu", "finetune.rl.server_url=http://rollouts.other:8000")
    assert not [o for o in out.objects if o["metadata"]["name"] == ROLLOUT]
    assert job_recipe(out.objects)["finetune"]["rl"]["server_url"] == "http://rollouts.other:8000"
    same = rendered("cpu", f"finetune.rl.server_url={URL}")  # this job's own Service: rendered
    assert named(same.objects, "Deployment", ROLLOUT)


def test_the_operator_takes_the_recipe_too():
    """The FineTune controller checks recipe_problems before it renders: no server_url is no problem."""
    recipe = load_recipe(SMOL, ["k8s.profile=cpu", *GRPO]).recipe
    assert recipe.finetune.rl.server_url is None and r.recipe_problems(recipe) == []


def test_local_rollouts_render_no_server():
    out = rendered("cpu", "finetune.rl.rollout=local")
    assert not [o for o in out.objects if o["kind"] in ("Deployment", "Service")]
    assert ROLLOUT_WAIT_ENV not in yaml.safe_dump(out.job)


@pytest.mark.process
@pytest.mark.parametrize("profile", PROFILES)
def test_render_check_validates_the_rollout_objects(cli, profile):
    args = [f"k8s.profile={profile}", *GRPO]
    result = cli("k8s", "render", SMOL, "--check", *args)
    assert result.code == 0, result.err
    assert "all valid" in result.err
    docs = [d for d in yaml.safe_load_all(cli("k8s", "render", SMOL, *args).out) if d]
    assert {("Deployment", ROLLOUT), ("Service", ROLLOUT)} <= {(d["kind"], d["metadata"]["name"]) for d in docs}


def test_submit_creates_the_rollout_server_and_delete_takes_it_with_the_job():
    from kubetune.k8s import follow

    from .fakes import FakeClient

    fake = FakeClient()
    lines = follow.submit(fake, rendered())
    assert any(f"Deployment {NS}/{ROLLOUT}" in line for line in lines), lines
    assert fake.get("v1", "Service", ROLLOUT, NS) is not None
    gone = follow.delete(fake, JOB, NS)
    assert {f"deleted {kind} {NS}/{ROLLOUT}" for kind in ("Deployment", "Service", "NetworkPolicy")} <= set(gone)
    assert fake.get("apps/v1", "Deployment", ROLLOUT, NS) is None
