"""The alert rules with the real promtool: `promtool check rules` passes, and for every alert a
`promtool test rules` case that fires it and one that does not (input series written here, the
expected annotations rendered from the rule's own templates)."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from kubetune.k8s.validate import validate_objects
from kubetune.monitor.objects import prometheus_rule
from kubetune.monitor.rules import RuleSettings, alerts, rule_file

pytestmark = pytest.mark.process

ALERTS = {a.name: a for a in alerts()}
J = 'job="j"'


def _buckets(metric: str, labels: str, counts: dict[str, str]) -> list[dict]:
    """Histogram bucket series `metric_bucket{labels, le}` with promtool value notation per bound."""
    return [{"series": f'{metric}_bucket{{{labels},le="{le}"}}', "values": v} for le, v in counts.items()]


def _collective(slow_rank_bucket: str) -> list[dict]:
    """Two ranks' all_reduce latency: rank 1 always under 1 ms, rank 0 in `slow_rank_bucket`."""
    series = []
    for rank, bucket in (("0", slow_rank_bucket), ("1", "0.001")):
        labels = f'{J},rank="{rank}",node="n{rank}",op="all_reduce",size_bucket="16MiB"'
        counts = {le: ("0+10x30" if float(le) >= float(bucket) else "0x30") for le in ("0.001", "0.01", "0.1")}
        series += _buckets("kubetune_collective_seconds", labels, {**counts, "+Inf": "0+10x30"})
    return series


def _ttft(bucket: str) -> list[dict]:
    counts = {le: ("0+10x20" if float(le) >= float(bucket) else "0x20") for le in ("1", "3", "5")}
    return _buckets("vllm:time_to_first_token_seconds", 'model_name="m"', {**counts, "+Inf": "0+10x20"})


# alert -> (eval time, labels of the firing alert, its $value, series that fire it, series that do not)
CASES = {
    "KubetuneTrainingStalled": (
        "20m", {"job": "j"}, 0,
        [{"series": f"kubetune_train_step{{{J}}}", "values": "5x30"},
         {"series": f"kubetune_train_total_steps{{{J}}}", "values": "100x30"}],
        [{"series": f"kubetune_train_step{{{J}}}", "values": "0+1x30"},
         {"series": f"kubetune_train_total_steps{{{J}}}", "values": "100x30"}],
    ),
    "KubetuneLossNotFinite": (
        "10m", {"job": "j", "rank": "0"}, 1,
        [{"series": f'kubetune_train_loss{{{J},rank="0"}}', "values": "2 2 NaN NaN NaN NaN NaN NaN NaN NaN NaN"}],
        [{"series": f'kubetune_train_loss{{{J},rank="0"}}', "values": "2-0.1x10"},
         {"series": f'kubetune_train_nonfinite_steps_total{{{J},rank="0"}}', "values": "0 0 1 1 2 2 2 2 2 2 2"}],
    ),
    "KubetuneRankRestarting": (
        # a container restarted 3 times: every counter starts again from 0, "resumed" reads 1 in each
        "40m", {"job": "j", "rank": "1"}, None,
        [{"series": f'kubetune_train_restarts_total{{{J},rank="1"}}', "values": "0 0 1 1 1 1 1 1"},
         {"series": f'kubetune_train_tokens_total{{{J},rank="1"}}', "values": "0 100 20 120 30 130 40 140"}],
        [{"series": f'kubetune_train_restarts_total{{{J},rank="1"}}', "values": "0 0 1 1 1 1 1 1"},
         {"series": f'kubetune_train_tokens_total{{{J},rank="1"}}', "values": "0 100 20 120 220 320 420 520"}],
    ),
    "KubetuneMemoryNearBudget": (
        "5m", {"job": "j", "rank": "0"}, 0.98,
        [{"series": f'kubetune_train_memory_bytes{{{J},rank="0"}}', "values": "98x10"},
         {"series": f'kubetune_train_memory_budget_bytes{{{J},rank="0"}}', "values": "100x10"}],
        [{"series": f'kubetune_train_memory_bytes{{{J},rank="0"}}', "values": "90x10"},
         {"series": f'kubetune_train_memory_budget_bytes{{{J},rank="0"}}', "values": "100x10"}],
    ),
    "KubetuneCollectiveSlow": (
        # rank 0's p99 lies in (0.01, 0.1]: 0.01 + 0.09 * 0.99 = 0.0991 s, the job's median 0.001 s
        "25m", {"job": "j", "rank": "0", "node": "n0", "op": "all_reduce", "size_bucket": "16MiB"}, 99.1,
        _collective("0.1"),
        _collective("0.001"),
    ),
    "KubetuneServingQueueGrowing": (
        "15m", {"model_name": "m"}, 1 / 60,
        [{"series": 'vllm:num_requests_waiting{model_name="m"}', "values": "0+1x20"}],
        [{"series": 'vllm:num_requests_waiting{model_name="m"}', "values": "3x20"}],
    ),
    "KubetuneServingSlowFirstToken": (
        # every first token in (3, 5] s: p99 = 3 + 2 * 0.99 = 4.98 s
        "15m", {"model_name": "m"}, 4.98,
        _ttft("5"),
        _ttft("1"),
    ),
}  # fmt: skip


def render_template(text: str, labels: dict[str, str], value: float | None) -> str:
    """The subset of Prometheus's alert templating the rules use: $labels.x, $value with
    humanizePercentage (Go's `%.4g%%` of value*100) or printf."""

    def one(m: re.Match[str]) -> str:
        body = m.group(1).strip()
        if body.startswith("$labels."):
            return labels.get(body.removeprefix("$labels."), "")
        assert value is not None, f"give the alert's $value to render {body!r}"
        if body == "$value | humanizePercentage":
            return f"{value * 100:.4g}%"
        fmt = re.fullmatch(r'\$value \| printf "(%[^"]+)"', body)
        assert fmt, f"unknown template {body!r}"
        return fmt.group(1) % value

    return re.sub(r"\{\{(.*?)\}\}", one, text)


# more series that must fire an alert: torchrun restarts a rank's worker 3 times (the pod's metrics
# directory keeps the dead workers' counts, so tokens never reset and "resumed" sums to 3)
ALSO_FIRING = {
    "KubetuneRankRestarting": [
        [
            {"series": f'kubetune_train_restarts_total{{{J},rank="1"}}', "values": "0 0 1 1 2 2 3 3"},
            {"series": f'kubetune_train_tokens_total{{{J},rank="1"}}', "values": "0+100x7"},
        ]
    ]
}


def _unit_tests(name: str) -> dict:
    at, labels, value, firing, quiet = CASES[name]
    alert = ALERTS[name]
    annotations = alert.rule()["annotations"]
    expected = {
        "exp_labels": {**labels, "severity": alert.severity},
        "exp_annotations": {k: render_template(v, labels, value) for k, v in annotations.items()},
    }
    cases = [(firing, [expected]), (quiet, [])] + [(more, [expected]) for more in ALSO_FIRING.get(name, [])]
    tests = [
        {"interval": "1m", "input_series": series,
         "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": alerts}]}
        for series, alerts in cases
    ]  # fmt: skip
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}


@pytest.fixture
def rules_dir(tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_file(), sort_keys=False))
    return tmp_path


def test_promtool_check_rules_passes(promtool, rules_dir):
    result = subprocess.run([promtool, "check", "rules", str(rules_dir / "rules.yaml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_case():
    assert set(CASES) == set(ALERTS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_promtool_unit_tests(promtool, rules_dir, name):
    (rules_dir / "tests.yaml").write_text(yaml.safe_dump(_unit_tests(name), sort_keys=False))
    result = subprocess.run(
        [promtool, "test", "rules", "tests.yaml"], capture_output=True, text=True, cwd=rules_dir, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_wrong_expectation_fails(promtool, rules_dir):
    # the unit tests can fail: the stall alert expected on a job that makes progress
    tests = _unit_tests("KubetuneTrainingStalled")
    tests["tests"][1]["alert_rule_test"][0]["exp_alerts"] = tests["tests"][0]["alert_rule_test"][0]["exp_alerts"]
    (rules_dir / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", "tests.yaml"], capture_output=True, text=True, cwd=rules_dir)
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr


def test_every_alert_says_what_to_do():
    for alert in alerts():
        annotations = alert.rule()["annotations"]
        assert set(annotations) == {"summary", "description", "runbook"}, alert.name
        assert all(len(text) > 40 for text in annotations.values()), alert.name
        assert alert.severity in ("critical", "warning")


def test_thresholds_are_settings():
    strict = {a.name: a for a in alerts(RuleSettings(memory_ratio=0.9, ttft_p99_seconds=0.5, stall_minutes=30))}
    assert strict["KubetuneMemoryNearBudget"].expr.endswith("> 0.9")
    assert strict["KubetuneServingSlowFirstToken"].expr.endswith("> 0.5")
    assert strict["KubetuneTrainingStalled"].for_ == "25m" and "30 minutes" in strict["KubetuneTrainingStalled"].summary


def test_the_prometheus_rule_validates_against_the_crd():
    rule = prometheus_rule("monitoring", "prom")
    assert rule["metadata"]["labels"]["release"] == "prom"
    assert rule["spec"]["groups"] == rule_file()["groups"]
    assert validate_objects([rule]) == []
    rule["spec"]["groups"][0]["rules"][0]["severity"] = "page"  # a field a rule does not have
    (problem,) = validate_objects([rule])
    assert "severity: unknown field" in problem
