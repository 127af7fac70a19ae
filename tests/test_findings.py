"""The Finding both diagnosing commands report (`k8s doctor`, `monitor check`): its order and exit rule."""

from kubetune.contracts.findings import Finding, has_errors, worst_first


def test_worst_first_orders_by_severity_and_keeps_the_order_within_one():
    found = [
        Finding("ok", "a", "up"),
        Finding("warning", "b", "slow"),
        Finding("error", "c", "down", "restart it"),
        Finding("info", "d", "nothing wrong"),
        Finding("error", "e", "gone"),
    ]
    assert [f.subject for f in worst_first(found)] == ["c", "e", "b", "d", "a"]


def test_only_an_error_fails_the_command():
    assert not has_errors([Finding("warning", "b", "slow"), Finding("ok", "a", "up"), Finding("info", "d", "note")])
    assert has_errors([Finding("ok", "a", "up"), Finding("error", "c", "down")])
