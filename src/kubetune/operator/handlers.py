"""The kopf handlers of FineTune, thin: read, call `plan` (pure) and `actions` (the client), write status.

- create / resume: validate the recipe (the CLI's loader), create the job's objects, owned.
  A bad recipe is a permanent error: status.conditions[Valid] holds one line per problem and
  nothing is created; kopf does not retry it (editing the spec does).
- update of spec: a recipe edit is applied to the job's ConfigMap only when every changed key
  keeps the run resumable (rundir.NEUTRAL), else refused in status.conditions[RecipeChange];
  suspend, resume and serve act at once.
- a timer (every `interval` seconds: the throttle): observe the job, its pods, the export
  Job and the serving Deployment, take the next step (`plan.next_step`), write status. After
  creation it is the only writer of status.conditions (a list: two writers would lose updates).

- spec.export.register: the export Job registers the model after the gate; what it registered
  (or why not) comes back in its termination message: status.registered, the Registered condition.
- spec.serve.server: after training the adapter goes to that ModelServer (`serverplan`: a
  version, the adapter-export Job, registered in status.adapter); the ModelServer's timer
  (`modelserver.py`) loads it on the replicas, and this timer reports it per replica.

Cluster errors (unreachable, 409 on our own writes, a Kubeflow CRD not installed yet: 404)
are temporary: kopf retries after a delay. Deleting a FineTune deletes what it owns through
Kubernetes' garbage collector (ownerReferences); the delete handler only unloads a served
adapter from its ModelServer's replicas and unregisters it (a Job the server owns).
"""

from __future__ import annotations

import copy
import logging
from datetime import datetime, timezone
from typing import Any

import kopf

from kubetune.contracts.gate import line as gate_line
from kubetune.errors import RecipeError, UserError
from kubetune.k8s.modelserver import ModelServerSpec
from kubetune.k8s.names import Names, server_selector
from kubetune.k8s.objects import config_map
from kubetune.kubeapi import ClusterError, KubeClient, connect, load_config
from kubetune.operator import actions, modelserver, plan, replicas, serverplan
from kubetune.operator.crd import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kubetune.rundir import changed_keys

RESOURCE = (GROUP, VERSION, PLURAL)
RETRY_DELAY_S = 30
# Waiting for spec.hfTokenSecretRef's Secret: `submit --via-operator` creates it just after the
# FineTune, so the first looks come soon; then less often, each one a line in the log, up to a
# minute apart (how long a user waits after creating the Secret).
TOKEN_RETRY_DELAY_S = 10
TOKEN_RETRY_MAX_S = 60
log = logging.getLogger("kubetune.operator")


def register(registry: kopf.OperatorRegistry, interval: float = 15.0) -> None:
    """The handlers of FineTune, in `registry` (the timer's interval is the status throttle)."""
    kopf.on.startup(registry=registry)(_startup)
    kopf.on.login(registry=registry)(_login)
    kopf.on.create(*RESOURCE, registry=registry)(_created)
    kopf.on.resume(*RESOURCE, registry=registry)(_created)
    kopf.on.update(*RESOURCE, field="spec", registry=registry)(_spec_changed)
    kopf.timer(*RESOURCE, interval=interval, registry=registry)(_follow)
    kopf.on.delete(*RESOURCE, registry=registry, optional=True)(_deleted)
    modelserver.register(registry, interval)


def _startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's own bookkeeping stays in annotations: status holds only the CRD's declared fields
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kubetune.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kubetune.io")
    settings.persistence.finalizer = "kubetune.io/operator"
    # no cluster-wide scans of namespaces and CRDs: the operator's RBAC stays namespace-sized
    # (the FineTune CRD is installed before the operator starts, e.g. by the Helm chart)
    settings.scanning.disabled = True
    memo["client"] = connect()


def _login(**_kwargs: Any) -> kopf.ConnectionInfo:
    """kopf talks to the API server found by kubetune's one kubeconfig loader (kubetune.contracts.kube)."""
    config = load_config()
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
    )


def _plain(body: kopf.Body) -> dict[str, Any]:
    return copy.deepcopy(dict(body))


def _now() -> str:
    return plan.now_text()


def _set_condition(patch: kopf.Patch, body: dict[str, Any], new: dict[str, Any]) -> None:
    current = patch.status.get("conditions") or (body.get("status") or {}).get("conditions") or []
    patch.status["conditions"] = plan.with_condition(list(current), new, _now())


def _temporary(e: ClusterError) -> kopf.TemporaryError:
    return kopf.TemporaryError(e.problems[0], delay=RETRY_DELAY_S)


def _say(ft: dict[str, Any], message: str, level: int = logging.INFO) -> None:
    """One line of the operator's log about one FineTune, `[namespace/name] message` as kopf
    prefixes its own lines about an object; a multi-line message (problems) is joined onto one."""
    name, namespace = actions.meta(ft)
    log.log(level, "[%s/%s] %s", namespace, name, "; ".join(message.splitlines()))


def _say_created(ft: dict[str, Any], created: list[str]) -> None:
    for what in created:  # `Kind/name`, only those created now (not the ones a retry found existing)
        _say(ft, f"created {what}")


# ------------------------------------------------------------------ create / resume


def _created(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, retry: int = 0, **_: Any) -> None:
    client: KubeClient = memo["client"]
    ft = _plain(body)
    spec = plan.FineTuneSpec.from_dict(ft.get("spec") or {})
    generation = ft["metadata"].get("generation")
    try:
        recipe = actions.applied_recipe(client, ft) or actions.spec_recipe(client, ft, spec)
        _refuse_another_base(client, ft, spec, recipe)
        created = actions.create_training(client, ft, spec, recipe)
    except WrongBase as e:
        raise _refuse(patch, ft, "WrongBase", "wrong base", e.problems) from None
    except RecipeError as e:
        raise _refuse(patch, ft, "InvalidRecipe", "invalid recipe", e.problems) from None
    except actions.TokenSecretMissing as e:
        raise _wait_for_token(patch, ft, e, retry) from None
    except ClusterError as e:
        raise _temporary(e) from None
    except UserError as e:  # the renderer's refusals (a token in the recipe, ...): the spec must change
        raise _refuse(patch, ft, "CannotRender", "cannot render", e.problems) from None
    _set_condition(patch, ft, plan.condition("Valid", True, "RecipeValid", "", generation))
    name, namespace = actions.meta(ft)
    api_version, kind = actions.JOB_KINDS[recipe.k8s.api]
    patch.status["jobRef"] = {"apiVersion": api_version, "kind": kind, "name": name}
    patch.status["artifacts"] = plan.artifacts(recipe, Names.for_job(name, namespace).pvc, spec.export_wanted(recipe))
    if not (ft.get("status") or {}).get("phase") or ft["status"]["phase"] == "Failed":
        patch.status["phase"] = "Suspended" if spec.suspend else "Pending"
    if generation is not None:
        patch.status["observedGeneration"] = generation
    if created:  # else a repeated call (kopf's retry, a resume after a restart) found everything made
        phase = patch.status.get("phase") or ft["status"]["phase"]
        _say(ft, f"accepted: the recipe is valid; {kind} {name}, {recipe.k8s.replicas} replicas; phase {phase}")
        _say_created(ft, created)


class WrongBase(UserError):
    """spec.serve.server serves another base than the recipe trains on."""


def _refuse_another_base(client: KubeClient, ft: dict[str, Any], spec: plan.FineTuneSpec, recipe: Any) -> None:
    """Before any training: an adapter of this run could never be served on spec.serve.server.
    (A server created later is checked when training has succeeded, before the export.)"""
    if not spec.serve.server:
        return
    server = actions.model_server(client, spec.serve.server, actions.meta(ft)[1])
    if server is None:
        return
    server_spec = ModelServerSpec.from_dict(server.get("spec") or {})
    mismatch = serverplan.base_mismatch(recipe, spec.serve.server, server_spec)
    if mismatch:
        raise WrongBase(mismatch)


def _refuse(patch: kopf.Patch, ft: dict[str, Any], reason: str, what: str, problems: list[str]) -> kopf.PermanentError:
    """A spec that can never run: Valid=False with one line per problem, phase Failed, and the
    permanent error kopf logs (and posts as the FineTune's Event) as the one line saying so."""
    generation = ft["metadata"].get("generation")
    _set_condition(patch, ft, plan.condition("Valid", False, reason, "\n".join(problems), generation))
    patch.status["phase"] = "Failed"
    lines = [line for problem in problems for line in problem.splitlines()]
    return kopf.PermanentError(f"refused, {what}: {'; '.join(lines)} (edit the spec to retry)")


def _wait_for_token(patch: kopf.Patch, ft: dict[str, Any], e: ClusterError, retry: int) -> kopf.TemporaryError:
    """The token's Secret is not there yet: Valid=False saying which and how to create it, phase
    Pending, nothing created; kopf retries (one log line per try, no traceback) until it appears."""
    generation = ft["metadata"].get("generation")
    _set_condition(patch, ft, plan.condition("Valid", False, "TokenSecretMissing", e.problems[0], generation))
    patch.status["phase"] = "Pending"
    return kopf.TemporaryError(e.problems[0], delay=min(TOKEN_RETRY_DELAY_S * (retry + 1), TOKEN_RETRY_MAX_S))


# ------------------------------------------------------------------ spec edits


def _spec_changed(body: kopf.Body, old: Any, new: Any, patch: kopf.Patch, memo: kopf.Memo, **kw: Any) -> None:
    ft = _plain(body)
    valid = next((c for c in (ft.get("status") or {}).get("conditions") or [] if c.get("type") == "Valid"), None)
    if valid is None or valid.get("status") != "True":
        _created(body=body, patch=patch, memo=memo, **kw)  # a fixed spec gets its first create now
        return
    client: KubeClient = memo["client"]
    before, after = old or {}, new or {}
    if (before.get("recipe"), before.get("recipeRef")) != (after.get("recipe"), after.get("recipeRef")):
        # status.conditions is one list that the timer alone writes (two writers would lose each
        # other's updates): the outcome waits in this object's memo for the timer's next tick
        outcome = _recipe_edit(client, ft)
        if outcome is not None:  # None: nothing new (kopf may call again for the same edit)
            memo["recipe_change"] = outcome
            if outcome != memo.get("recipe_said"):  # kopf may hand the same edit over again
                memo["recipe_said"] = outcome
                level = logging.INFO if outcome["status"] == "True" else logging.WARNING
                _say(ft, f"recipe edit: {outcome['message']}", level)
    try:
        _advance(client, ft, patch)  # suspend / resume / serve act now, not at the next tick
    except ClusterError as e:
        raise _temporary(e) from None


def _recipe_edit(client: KubeClient, ft: dict[str, Any]) -> dict[str, Any] | None:
    """Apply an edited recipe to the job's ConfigMap if the run stays resumable; the condition saying so."""
    spec = plan.FineTuneSpec.from_dict(ft.get("spec") or {})
    generation = ft["metadata"].get("generation")
    try:
        running = actions.applied_recipe(client, ft)
        edited = actions.spec_recipe(client, ft, spec)
    except RecipeError as e:
        msg = "\n".join(["the edited recipe is invalid; the job keeps its recipe:", *e.problems])
        return plan.condition("RecipeChange", False, "InvalidRecipe", msg, generation)
    except ClusterError as e:
        raise _temporary(e) from None
    resumable, learned = changed_keys(running, edited) if running else ([], [])
    if not resumable and not learned:
        return None  # what the job runs already (e.g. this edit was handled before)
    if learned:
        msg = (
            f"not applied: changing {', '.join(learned)} changes what is learned, so the run could not resume "
            "from its checkpoints; revert it, or create a new FineTune (keys that keep a run resumable: "
            "train.max_steps, train.epochs, train.save_every, eval.*, k8s.*, ...)"
        )
        return plan.condition("RecipeChange", False, "NotResumable", msg, generation)
    name, namespace = actions.meta(ft)
    cm = plan.owned([config_map(edited, Names.for_job(name, namespace))], ft, False)[0]
    try:
        client.patch(cm)
    except ClusterError as e:
        raise _temporary(e) from None
    msg = (
        f"applied {', '.join(resumable)}: the training pods read it when they (re)start; "
        "suspend and resume to restart them now"
    )
    return plan.condition("RecipeChange", True, "Applied", msg, generation)


# ------------------------------------------------------------------ following the job


def _follow(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    ft = _plain(body)
    status = ft.get("status") or {}
    if not any(c.get("type") == "Valid" and c.get("status") == "True" for c in status.get("conditions") or []):
        return  # not created (yet, or an invalid recipe): the create handler speaks for it
    client: KubeClient = memo["client"]
    try:
        seen, observed, step = _advance(client, ft, patch)
        failed = _write_status(client, ft, seen, observed, step, patch)
        _say_news(ft, memo, seen, step, failed or _why(ft, observed, step))
        # a finished job (succeeded or failed) goes after spec.ttlSecondsAfterFinished: after its
        # status (and diagnosis) is written, which stays
        ttl = plan.FineTuneSpec.from_dict(ft.get("spec") or {}).ttl_seconds
        expired = seen.job is not None and plan.ttl_expired(seen.job, ttl, datetime.now(timezone.utc))
        if expired and actions.delete_training(client, *actions.meta(ft)):
            _say(ft, f"deleted the finished job and its pods (spec.ttlSecondsAfterFinished {ttl}s)")
    except ClusterError as e:
        raise _temporary(e) from None
    except UserError as e:
        _set_condition(patch, ft, plan.condition("Ready", False, "CannotRender", "\n".join(e.problems)))
    _write_recipe_change(ft, memo, patch)


def _write_recipe_change(ft: dict[str, Any], memo: kopf.Memo, patch: kopf.Patch) -> None:
    """The outcome of the last recipe edit, rewritten every tick until the body shows it: a tick
    can start from a body that predates the previous tick's patch, and its conditions (one
    list, replaced whole) would drop a RecipeChange written only once."""
    pending = memo.get("recipe_change")
    if pending is None:
        return
    shown = next((c for c in (ft.get("status") or {}).get("conditions") or [] if c.get("type") == "RecipeChange"), None)
    if shown is not None and all(shown.get(k) == v for k, v in pending.items()):
        if memo.get("recipe_change") is pending:  # not an edit that arrived meanwhile
            memo.pop("recipe_change", None)
    else:
        _set_condition(patch, ft, pending)


def _advance(
    client: KubeClient, ft: dict[str, Any], patch: kopf.Patch
) -> tuple[actions.Observation, plan.Observed, plan.Step]:
    """Observe, decide (plan.next_step) and act; status is the caller's to write."""
    spec = plan.FineTuneSpec.from_dict(ft.get("spec") or {})
    status = ft.get("status") or {}
    recipe = actions.applied_recipe(client, ft) or actions.spec_recipe(client, ft, spec)
    seen = actions.observe(client, ft, recipe, spec.serve.server)
    trained = status.get("phase") in plan.TRAINED_PHASES
    server_spec = ModelServerSpec.from_dict(seen.server.get("spec") or {}) if seen.server else None
    observed = plan.Observed(
        suspend=spec.suspend,
        trained=trained,
        failed_before=status.get("phase") == "Failed",
        job_exists=seen.job is not None,
        job_state=plan.job_state(seen.job),
        export_wanted=spec.export_wanted(recipe),
        export_state=plan.export_state(seen.export_job),
        serve_enabled=spec.serve.enabled,
        serving=seen.serving is not None,
        adapter_server=spec.serve.server,
        server_found=seen.server is not None,
        base_mismatch=serverplan.base_mismatch(recipe, spec.serve.server or "", server_spec) if server_spec else None,
        adapter_export_state=plan.export_state(seen.adapter_export_job),
        gate=plan.gate_verdict(seen.export_pods) or status.get("gate"),  # status: once the pods are gone
        register_error=plan.register_error(seen.export_pods),
    )
    step = plan.next_step(observed)
    _act(client, ft, spec, recipe, step.actions, patch, seen)
    return seen, observed, step


def _act(
    client: KubeClient,
    ft: dict[str, Any],
    spec: plan.FineTuneSpec,
    recipe: Any,
    todo: tuple[str, ...],
    patch: kopf.Patch,
    seen: actions.Observation | None = None,
) -> None:
    name, namespace = actions.meta(ft)
    for action in todo:
        if action in ("create-adapter-export", "register-adapter") and seen is not None:
            _act_on_server(client, ft, spec, recipe, action, patch, seen)
        if action == "create-training":
            _say_created(ft, actions.create_training(client, ft, spec, recipe))
        elif action == "delete-training" and actions.delete_training(client, name, namespace):
            _say(ft, "deleted the job and its pods (spec.suspend); the volume claim stays")
        elif action == "create-export":
            _say_created(ft, actions.create_export(client, ft, spec, recipe))
            patch.status["exportJobRef"] = {"apiVersion": "batch/v1", "kind": "Job", "name": name + plan.EXPORT_SUFFIX}
        elif action == "create-serving":
            objects = actions.serving_objects(ft, spec, recipe)
            created = actions.create_all(client, objects)
            patch.status["endpoint"] = plan.endpoint(objects)
            _say_created(ft, created)
            if created:
                _say(ft, f"the OpenAI endpoint is {patch.status['endpoint']}")


def _act_on_server(
    client: KubeClient,
    ft: dict[str, Any],
    spec: plan.FineTuneSpec,
    recipe: Any,
    action: str,
    patch: kopf.Patch,
    seen: actions.Observation,
) -> None:
    """spec.serve.server: export the adapter into the server (a new version), then register it:
    status.adapter.registered, which the ModelServer's timer reads as its registry."""
    assert seen.server is not None and spec.serve.server is not None
    name, namespace = actions.meta(ft)
    server = ModelServerSpec.from_dict(seen.server.get("spec") or {})
    current = serverplan.AdapterRef.from_status((ft.get("status") or {}).get("adapter"))
    if action == "create-adapter-export":
        if current is None or current.server != spec.serve.server:
            finetunes = client.list(API_VERSION, KIND, namespace)
            adapter = spec.serve.adapter_name or name
            listed = (seen.server.get("status") or {}).get("adapters") or []
            taken = serverplan.taken_versions(adapter, spec.serve.server, finetunes, listed)
            current = actions.claim_version(client, seen.server, name, adapter, taken)
        patch.status["adapter"] = current.status()
        _say_created(ft, actions.create_adapter_export(client, ft, spec, recipe, current, server))
        job = name + serverplan.ADAPTER_EXPORT_SUFFIX
        patch.status["exportJobRef"] = {"apiVersion": "batch/v1", "kind": "Job", "name": job}
    elif current is not None and not current.registered:
        patch.status["adapter"] = {**current.status(), "registered": True}
        _say(ft, f"registered {current.served_name} on ModelServer {current.server} ({current.path})")


def _write_server_status(
    ft: dict[str, Any], seen: actions.Observation, observed: plan.Observed, patch: kopf.Patch
) -> None:
    """Conditions of a FineTune served by a ModelServer: the server missing, another base, and
    per replica whether the adapter is loaded (and why not); the endpoint and served name."""
    server = observed.adapter_server
    if not observed.server_found:
        msg = f"ModelServer {server} does not exist in this namespace (yet); create it, or fix spec.serve.server"
        _set_condition(patch, ft, plan.condition("AdapterLoaded", False, "ServerNotFound", msg))
        return
    if observed.base_mismatch:
        _set_condition(patch, ft, plan.condition("AdapterLoaded", False, "WrongBase", observed.base_mismatch))
        return
    ref = serverplan.AdapterRef.from_status(patch.status.get("adapter") or (ft.get("status") or {}).get("adapter"))
    if ref is None or seen.server is None or observed.adapter_export_state != "Complete":
        return
    status = seen.server.get("status") or {}
    ok, reason, message = serverplan.loaded_condition_text(server or "", ref.served_name, status.get("pods") or [])
    _set_condition(patch, ft, plan.condition("AdapterLoaded", ok, reason, message))
    _set_condition(patch, ft, plan.condition("Ready", ok, "AdapterServed" if ok else reason, message))
    if status.get("endpoint"):
        patch.status["endpoint"] = status["endpoint"]


def _write_status(
    client: KubeClient,
    ft: dict[str, Any],
    seen: actions.Observation,
    observed: plan.Observed,
    step: plan.Step,
    patch: kopf.Patch,
) -> str | None:
    """status from what was observed; when the run has just failed, why."""
    name, namespace = actions.meta(ft)
    status = ft.get("status") or {}
    generation = ft["metadata"].get("generation")
    patch.status["phase"] = step.phase
    if generation is not None:
        patch.status["observedGeneration"] = generation
    if seen.job is not None and not observed.trained:  # after success the last reading stays
        found = actions.read_progress(client, name, namespace, seen)
        if found is not None:
            patch.status["progress"] = plan.progress_status(*found)
    training = observed.job_state or ("Suspended" if observed.suspend else "NotStarted")
    _set_condition(patch, ft, plan.condition("Training", observed.job_state in plan.RUNNING, training))
    suspended = step.phase == "Suspended"
    reason = "SuspendedBySpec" if suspended else "NotSuspended"
    _set_condition(patch, ft, plan.condition("Suspended", suspended, reason))
    if seen.restarts > status.get("restarts", 0):
        patch.status["restarts"] = seen.restarts
        diagnosed = "\n".join(actions.diagnosis(client, name, namespace)) or "a training pod restarted"
        _set_condition(patch, ft, plan.condition("Restarted", True, "PodRestarted", diagnosed))
    failed = _write_failure(client, ft, observed, step, patch)
    lm_eval = plan.lm_eval_results(seen.export_pods)
    if lm_eval is not None:
        patch.status["lmEval"] = lm_eval
    if observed.gate is not None:
        patch.status["gate"] = observed.gate
        passed = bool(observed.gate["passed"])
        reason = "GatePassed" if passed else "GateFailed"
        _set_condition(patch, ft, plan.condition("GatePassed", passed, reason, gate_line(observed.gate)))
    merges = seen.recipe.finetune.method == "lora"
    if observed.export_state == "Complete" and merges and (observed.gate is None or observed.gate["passed"]):
        _set_condition(patch, ft, plan.condition("Exported", True, "MergedExport"))
    _write_registered(ft, seen, observed, patch)
    if observed.adapter_server:
        _write_server_status(ft, seen, observed, patch)
    elif step.phase == "Serving":
        _set_condition(patch, ft, plan.condition("Ready", True, "ServingObjectsCreated", status.get("endpoint", "")))
    return failed


def _write_registered(
    ft: dict[str, Any], seen: actions.Observation, observed: plan.Observed, patch: kopf.Patch
) -> None:
    """spec.export.register: status.registered (the registry's model and version, read from the
    export pod) and the Registered condition: the model, or why not (the registry refused it, or
    the gate failed: a run whose gate failed is never registered)."""
    if plan.FineTuneSpec.from_dict(ft.get("spec") or {}).register is None:
        return
    registered = plan.registered_model(seen.export_pods)
    if registered is not None:
        patch.status["registered"] = registered
        what = f"{registered['name']} version {registered['version']} in {registered['registry']}"
        _set_condition(patch, ft, plan.condition("Registered", True, "ModelRegistered", what))
    elif observed.register_error is not None:
        _set_condition(patch, ft, plan.condition("Registered", False, "RegistrationFailed", observed.register_error))
    elif observed.gate is not None and not observed.gate["passed"]:
        why = f"not registered: the eval gate failed ({gate_line(observed.gate)})"
        _set_condition(patch, ft, plan.condition("Registered", False, "GateFailed", why))


def _write_failure(
    client: KubeClient, ft: dict[str, Any], observed: plan.Observed, step: plan.Step, patch: kopf.Patch
) -> str | None:
    """The Failed condition when the run has just failed (training or export); what it says."""
    if step.phase != "Failed" or (ft.get("status") or {}).get("phase") == "Failed":
        return None
    name, namespace = actions.meta(ft)
    if observed.base_mismatch:
        _set_condition(patch, ft, plan.condition("Failed", True, "WrongBase", observed.base_mismatch))
        return observed.base_mismatch
    if observed.job_state == "Failed":
        why = "\n".join(actions.diagnosis(client, name, namespace)) or "the training job failed"
        _set_condition(patch, ft, plan.condition("Failed", True, "TrainingFailed", why))
        return why
    suffix = serverplan.ADAPTER_EXPORT_SUFFIX if observed.adapter_export_state == "Failed" else plan.EXPORT_SUFFIX
    job = name + suffix
    if observed.register_error is not None:
        msg = f"Job {job} could not register the model: {observed.register_error}"
        _set_condition(patch, ft, plan.condition("Failed", True, "RegistrationFailed", msg))
        return msg
    msg = f"Job {job} failed: `kubectl logs job/{job} -n {namespace}` says why"
    _set_condition(patch, ft, plan.condition("Failed", True, "ExportFailed", msg))
    return msg


CONCLUDED = {"Succeeded", "Failed", "Serving"}  # where a run ends up (until the spec changes)


def _say_news(ft: dict[str, Any], memo: kopf.Memo, seen: actions.Observation, step: plan.Step, why: str) -> None:
    """A line for a new phase and for new pod restarts, once each: what was said is kept in the
    object's memo, since a tick can start from a body that predates the previous tick's status
    (the status alone would say the same change twice)."""
    status = ft.get("status") or {}
    restarts = max(memo.get("restarts", 0), status.get("restarts", 0))
    if seen.restarts > restarts:
        memo["restarts"] = seen.restarts
        name, namespace = actions.meta(ft)
        shows = f"`kubetune k8s status {name} -n {namespace}` shows why"
        _say(ft, f"a training pod restarted (restarts: {seen.restarts}): {shows}", logging.WARNING)
    before = memo.get("phase") or status.get("phase")
    memo["phase"] = step.phase
    if step.phase != before:
        concluded = "; concluded" if step.phase in CONCLUDED else ""
        level = logging.WARNING if step.phase == "Failed" else logging.INFO
        _say(ft, f"phase {before or 'none'} -> {step.phase}: {why}{concluded}", level)


def _why(ft: dict[str, Any], observed: plan.Observed, step: plan.Step) -> str:
    """Why the phase is what it is now, in the words of what was observed (Failed has its own)."""
    name = actions.meta(ft)[0]
    status = ft.get("status") or {}
    job = (status.get("jobRef") or {}).get("kind", "the job")
    artifacts = status.get("artifacts") or {}
    if step.phase == "Suspended":
        return "spec.suspend is true"
    if step.phase == "Pending":
        return f"waiting for {job} {name} to run"
    if step.phase == "Running":
        return f"{job} {name} is {observed.job_state}"
    server = observed.adapter_server
    if step.phase == "Exporting" and server and not observed.server_found:
        return f"training succeeded; waiting for ModelServer {server}"
    if step.phase == "Exporting" and server and observed.export_state in (None, "Complete"):
        return f"training succeeded; Job {name}{serverplan.ADAPTER_EXPORT_SUFFIX} exports the adapter into {server}"
    if step.phase == "Exporting":
        return f"training succeeded; Job {name}{plan.EXPORT_SUFFIX} merges the adapter into the model"
    if step.phase == "Serving" and server:
        return f"ModelServer {server} serves the adapter"
    if step.phase == "Serving":  # the endpoint was said when created (status may not show it yet)
        return f"Deployment {name}-serve serves the model"
    if observed.gate is not None and not observed.gate["passed"]:
        return f"trained, not served: the eval gate failed ({gate_line(observed.gate)})"
    model = artifacts.get("merged") or artifacts.get("adapter") or "the run directory"
    return f"training succeeded; the model is in {model}"


# ------------------------------------------------------------------ deleting


def _deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A FineTune served by a ModelServer goes: its adapter is unloaded from every ready replica
    now, and a Job takes it out of the registry (its files stay unless the server's
    adapterStorage.retention is Delete). The ModelServer's timer unloads it too where this missed
    (it leaves the registry as soon as the FineTune is being deleted)."""
    client: KubeClient = memo["client"]
    ft = _plain(body)
    ref = serverplan.AdapterRef.from_status((ft.get("status") or {}).get("adapter"))
    if ref is None:
        return
    name, namespace = actions.meta(ft)
    try:
        server_body = actions.model_server(client, ref.server, namespace)
        if server_body is None:
            return  # the server (and its volume's registry, unless kept) went first
        pods = client.list("v1", "Pod", namespace, server_selector(ref.server))
        for replica in replicas.ready_replicas(pods, actions.server_api_key(client, server_body)):
            reason = replicas.unload(replica, ref.served_name)
            what = "unloaded" if reason is None else f"could not unload ({reason})"
            _say(ft, f"{what} {ref.served_name} from {replica.pod}")
        if ref.registered:
            _say_created(ft, actions.create_unregister(client, server_body, ref, name))
    except ClusterError as e:
        raise _temporary(e) from None
