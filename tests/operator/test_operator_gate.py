"""The eval gate in the operator, against kmock: the export Job of a gated run exports only a run
whose gate passed and says the verdict in its termination message; the operator reads it from
the export pod, serves only on a pass, and on a failure concludes Succeeded without serving,
with a GatePassed=False condition that carries the numbers."""

from __future__ import annotations

import pytest

from kubetune.contracts.gate import gate_message

from .conftest import NAMESPACE, wait_for
from .test_operator_api import PYTORCHJOB, _progress_log, _rank0_pod, _true

GATED = {
    "train": {"max_steps": 40, "save_every": 10},
    "k8s": {"replicas": 2, "amx_label": None},
    "eval": {"tasks": ["flashcards"], "gate": {"metric": "flashcards/rougeL", "tolerance": 0.01}},
}


def _export_pod(cluster, job: str, message: str) -> None:
    """The export Job's pod, ended, with the termination message `kubetune export --gate` wrote."""
    terminated = {"exitCode": 0, "reason": "Completed", "message": message}
    cluster.client.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{job}-abcde", "namespace": NAMESPACE, "labels": {"job-name": job}},
            "spec": {"containers": [{"name": "export", "image": "kubetune"}]},
            "status": {
                "phase": "Succeeded",
                "containerStatuses": [{"name": "export", "state": {"terminated": terminated}}],
            },
        }
    )


TABLE = {"flashcards": {"rougeL": {"base": 0.3, "tuned": 0.25}, "exact_match": {"base": 0.0, "tuned": 0.0}}}


def _train_and_export(operator, name: str, verdict: dict) -> None:
    operator.apply_finetune(name, {"recipe": GATED, "serve": {"enabled": True}})
    wait_for(lambda: operator.get(*PYTORCHJOB, name))
    _rank0_pod(operator, name, _progress_log(40, 40, 0.9))
    operator.set_status(*PYTORCHJOB, name, {"conditions": [_true("Created"), _true("Running"), _true("Succeeded")]})
    export = wait_for(lambda: operator.get("batch/v1", "Job", f"{name}-export"), message="the export Job")
    assert export["spec"]["template"]["spec"]["containers"][0]["command"][-1] == "--gate"
    _export_pod(operator, f"{name}-export", gate_message(verdict, TABLE))
    operator.set_status("batch/v1", "Job", f"{name}-export", {"succeeded": 1})


VERDICT = {"metric": "flashcards/rougeL", "base": 0.30, "threshold": None, "rule": "tuned >= base - 0.01"}


def test_a_failed_gate_is_not_served_and_says_why(operator):
    _train_and_export(operator, "worse", {**VERDICT, "passed": False, "tuned": 0.25})
    wait_for(lambda: operator.status("worse").get("phase") == "Succeeded", message="Succeeded without serving")
    gate = operator.condition("worse", "GatePassed")
    assert gate["status"] == "False" and gate["reason"] == "GateFailed"
    assert "flashcards/rougeL 0.3000 -> 0.2500 (tuned >= base - 0.01)" in gate["message"]
    assert operator.status("worse")["gate"]["passed"] is False
    assert operator.status("worse")["lmEval"] == TABLE  # base vs tuned in the FineTune's status
    assert operator.get("apps/v1", "Deployment", "worse-serve") is None
    assert operator.condition("worse", "Exported") is None


def test_a_passed_gate_is_served(operator):
    _train_and_export(operator, "better", {**VERDICT, "passed": True, "tuned": 0.35})
    wait_for(lambda: operator.get("apps/v1", "Deployment", "better-serve"), message="the Deployment")
    wait_for(lambda: operator.status("better").get("phase") == "Serving")
    assert operator.condition("better", "GatePassed")["status"] == "True"


@pytest.mark.parametrize("message", ["", "merged into /data/runs/x/merged", '{"gate": {"passed": "yes"}}'])
def test_other_termination_messages_are_no_verdict(message):
    from kubetune.operator.plan import gate_verdict, lm_eval_results

    pod = {"status": {"containerStatuses": [{"state": {"terminated": {"message": message}}}]}}
    assert gate_verdict([pod]) is None and lm_eval_results([pod]) is None


def test_the_message_fits_kubernetes_4_kib():
    """A table too large for a termination message is left out; the verdict always fits."""
    from kubetune.contracts.gate import read_gate_message, read_lm_eval_message

    huge = {f"task_{i}": {"acc": {"base": 0.123456789, "tuned": 0.5}} for i in range(200)}
    message = gate_message({**VERDICT, "passed": True, "tuned": 0.35}, huge)
    assert len(message.encode()) <= 4096
    assert read_gate_message(message)["passed"] is True and read_lm_eval_message(message) is None
    small = gate_message(None, {"flashcards": {"acc": {"base": 0.123456789, "tuned": 0.5}}})
    assert read_lm_eval_message(small) == {"flashcards": {"acc": {"base": 0.1235, "tuned": 0.5}}}


def test_a_gated_full_run_gets_a_job_that_only_checks_the_gate():
    from kubetune.k8s.export_job import export_command
    from kubetune.operator.plan import FineTuneSpec, artifacts
    from kubetune.recipe import load_recipe

    full = load_recipe(None, ["finetune.method=full", "eval.gate={metric: perplexity}"]).recipe
    served = FineTuneSpec.from_dict({"serve": {"enabled": True}})
    assert served.export_wanted(full)
    assert export_command(full) == ["kubetune", "export", full.output_dir, "--gate"]
    assert "merged" not in artifacts(full, "claim", True)
    ungated = load_recipe(None, ["finetune.method=full"]).recipe
    assert not served.export_wanted(ungated)  # served from its weights, as before


def test_a_gated_run_for_a_shared_server_checks_the_gate_in_its_adapter_export():
    from kubetune.k8s.export_job import adapter_install_command
    from kubetune.operator.plan import FineTuneSpec
    from kubetune.recipe import load_recipe

    gated = load_recipe(None, ["eval.gate={metric: perplexity}"]).recipe
    shared = FineTuneSpec.from_dict({"serve": {"enabled": True, "server": "shared"}})
    assert not shared.export_wanted(gated)  # no merged export: the adapter goes to the server as it is
    assert adapter_install_command(gated, "cardio", "v1", "org/base", None)[-1] == "--gate"
    ungated = load_recipe(None, []).recipe
    assert "--gate" not in adapter_install_command(ungated, "cardio", "v1", "org/base", None)
