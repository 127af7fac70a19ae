"""What `KubeClient.watch` yields: a `Listed` (every object, at a resourceVersion) whenever it
lists, and a `WatchEvent` per change in between.

A consumer keeps a view of the objects by replacing it on each `Listed` and applying each
`WatchEvent`; it never sees the watch's resourceVersions, bookmarks or 410s (the client's).
"""

from __future__ import annotations

from dataclasses import dataclass

from kubetune.contracts.kube import KubeObject

__all__ = ["Listed", "WatchEvent", "resource_version"]


@dataclass(frozen=True)
class Listed:
    """Every object there is, as of `resource_version`: the state to start from, or (after the
    server dropped the version a watch followed) the state that replaces all that was known."""

    items: list[KubeObject]
    resource_version: str


@dataclass(frozen=True)
class WatchEvent:
    """One change, in the server's order: ADDED | MODIFIED (the object as it is now) | DELETED (as it was)."""

    type: str
    object: KubeObject


def resource_version(event: KubeObject) -> str | None:
    """The resourceVersion a raw watch event moves to (its object's, a BOOKMARK's too); None without one."""
    return ((event.get("object") or {}).get("metadata") or {}).get("resourceVersion")
