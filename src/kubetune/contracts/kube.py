"""Kubernetes conventions shared by the recipe, `kubetune.k8s` (jobs) and `kubetune.cluster` (components).

- Quantities: one grammar (`8`, `500m`, `32Gi`, `1e3`, `+.5`), read two ways.
  `parse_quantity` gives the exact Decimal and raises ValueError on a malformed value (recipe
  checks, render arithmetic); `quantity_or_none` gives a float, None when absent or malformed
  (the scheduler extender reading Node and Pod objects, where bad data means "unknown").
- Labels: the `app.kubernetes.io/*` keys, and `common_labels`, which builds the set that
  every job object and every cluster component carries (always in the same key order).
- Objects: `KubeObject`, a plain dict in the API server's shape; `drop_none` leaves out the
  optional fields a renderer did not set.

Talking to an API server (the kubeconfig, the client) is `kubetune.kubeapi`'s, above this.
Standard library only: no torch, no `kubetune.training`, so every layer may import it.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

__all__ = [
    "COMPONENT",
    "INSTANCE",
    "KUBETUNE",
    "MANAGED_BY",
    "NAME",
    "PART_OF",
    "KubeObject",
    "common_labels",
    "drop_none",
    "parse_quantity",
    "quantity_or_none",
]

KubeObject = dict[str, Any]
"""A Kubernetes object, or a part of one, as plain JSON data (what render makes and the API returns)."""


def drop_none(fields: KubeObject) -> KubeObject:
    """`fields` without the ones set to None: an optional field left unset is left out of the
    object, as the API server writes it (an empty list or mapping stays)."""
    return {key: value for key, value in fields.items() if value is not None}


# ------------------------------------------------------------------------------ quantities

# <signed number>[<exponent> | <suffix>] as the API server reads it (resource.ParseQuantity),
# plus an exponent before a suffix ("1e3Ki"), which the recipe has always accepted.
_NUMBER = r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_QUANTITY = re.compile(rf"\s*({_NUMBER})([KMGTPE]i|[numkMGTPE]?)\s*")  # surrounding blanks: as UnmarshalJSON
# not formatted: a row per family (binary, decimal fractions, decimal multiples)
_FACTOR: dict[str, Decimal] = {
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30),
    "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60),
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9),
    "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18),
}  # fmt: skip
_FLOAT_FACTOR: dict[str, float] = {suffix: float(factor) for suffix, factor in _FACTOR.items()}


def parse_quantity(value: str | int | float) -> Decimal:
    """A Kubernetes quantity (`8`, `500m`, `32Gi`, `1e3`) as an exact number; ValueError if malformed."""
    m = _QUANTITY.fullmatch(str(value))
    if not m:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 8, 500m, 32Gi)")
    return Decimal(m.group(1)) * _FACTOR[m.group(2)]


def quantity_or_none(value: object) -> float | None:
    """A quantity as it comes in an API object (`8`, `"8"`, `"500m"`, `"96Gi"`) as a float; None if absent or bad.

    Same grammar as `parse_quantity`, read straight into a float without a Decimal: the
    scheduler extender reads one per node per request. JSON numbers pass through as they are.
    """
    if isinstance(value, str):
        m = _QUANTITY.fullmatch(value)
        if m is None:
            return None
        number, suffix = m.groups()
        return float(number) * _FLOAT_FACTOR[suffix]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


# ------------------------------------------------------------------------------ labels

NAME = "app.kubernetes.io/name"
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
PART_OF = "app.kubernetes.io/part-of"
MANAGED_BY = "app.kubernetes.io/managed-by"
KUBETUNE = "kubetune"


def common_labels(
    name: str,
    component: str | None = None,
    *,
    instance: str | None = None,
    part_of: str | None = None,
    managed_by: str | None = None,
) -> dict[str, str]:
    """The recommended `app.kubernetes.io/*` labels, always in this order; None leaves a label out.

    A job's objects: name=kubetune, instance=<job>, component, managed-by=kubetune (what
    `kubetune k8s delete` checks before removing a PVC or runtime). The cluster components:
    name=<component's name>, component, part-of=kubetune.
    """
    labels = {NAME: name}
    for key, value in ((INSTANCE, instance), (COMPONENT, component), (PART_OF, part_of), (MANAGED_BY, managed_by)):
        if value is not None:
            labels[key] = value
    return labels
