"""kubetune.contracts.kube: the quantity grammar, the common labels and `drop_none` that k8s and
cluster share."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kubetune.contracts import kube
from kubetune.contracts.kube import common_labels, drop_none, parse_quantity, quantity_or_none

SUFFIXES = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E"]


@pytest.mark.parametrize(
    "text,value",
    [
        ("8", 8),
        ("500m", Decimal("0.5")),
        ("96Gi", 96 * 2**30),
        ("1e3", 1000),
        ("+.5", Decimal("0.5")),
        ("5.", 5),
        ("-2", -2),
        ("7n", Decimal("7e-9")),
        ("4u", Decimal("4e-6")),
        (" 8Gi\n", 8 * 2**30),
        ("1E", 10**18),
        (3, 3),
    ],
)
def test_the_grammar_read_both_ways(text, value):
    assert parse_quantity(text) == value
    assert quantity_or_none(text) == pytest.approx(float(value), rel=1e-15)


@pytest.mark.parametrize("text", ["", "8 Gi", "8 cores", "Gi", "1.2.3", ".", "32GB", "0x10", "e3", "٣", "¹"])
def test_malformed_quantities(text):
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)
    assert quantity_or_none(text) is None


def test_api_values_that_are_not_strings():
    assert quantity_or_none(8) == 8.0 and quantity_or_none(2.5) == 2.5
    assert quantity_or_none(None) is None and quantity_or_none(True) is None and quantity_or_none([]) is None


@given(
    st.from_regex(r"\A[+-]?([0-9]{1,12}(\.[0-9]{0,6})?|\.[0-9]{1,6})([eE][+-]?[0-9]{1,2})?\Z"),
    st.sampled_from(SUFFIXES),
)
def test_float_and_decimal_readings_agree(number, suffix):
    exact = parse_quantity(number + suffix)
    assert quantity_or_none(number + suffix) == pytest.approx(float(exact), rel=1e-12, abs=1e-300)


@given(st.text(alphabet="0123456789.eE+- KMGTPinumk", max_size=8))
def test_one_grammar_accepts_the_same_texts(text):
    try:
        parse_quantity(text)
    except ValueError:
        assert quantity_or_none(text) is None
    else:
        assert quantity_or_none(text) is not None


def test_common_labels_keep_one_order_and_leave_unset_ones_out():
    assert list(common_labels("kubetune", "trainer", instance="run", managed_by="kubetune").items()) == [
        (kube.NAME, "kubetune"),
        (kube.INSTANCE, "run"),
        (kube.COMPONENT, "trainer"),
        (kube.MANAGED_BY, "kubetune"),
    ]
    assert list(common_labels("kubetune-device-plugin", "device-plugin", part_of="kubetune")) == [
        kube.NAME,
        kube.COMPONENT,
        kube.PART_OF,
    ]


def test_drop_none_leaves_out_only_the_fields_set_to_none_in_the_literals_order():
    # what the kubernetes client's sanitize_for_serialization did with a model's unset fields: an
    # empty list, an empty mapping, false, 0 and "" are values the API server keeps
    fields = {"z": [], "y": None, "x": {}, "w": False, "v": 0, "u": "", "t": None}
    assert list(drop_none(fields).items()) == [("z", []), ("x", {}), ("w", False), ("v", 0), ("u", "")]


def test_job_and_component_objects_use_the_common_labels():
    from kubetune.cluster import manifests
    from kubetune.k8s.names import Names, standard_labels

    assert standard_labels(Names.for_job("run", "ns"), "trainer") == {
        "app.kubernetes.io/name": "kubetune",
        "app.kubernetes.io/instance": "run",
        "app.kubernetes.io/component": "trainer",
        "app.kubernetes.io/managed-by": "kubetune",
    }
    for obj in manifests.render(manifests.ComponentSettings()):
        labels = obj["metadata"]["labels"]
        assert labels[kube.PART_OF] == "kubetune" and labels[kube.NAME].startswith("kubetune-"), obj["kind"]
