"""`KubeClient.watch` against kmock answering as an API server with a history of versions would.

kmock's own watch replays every object and ignores resourceVersion, so these tests script the
pods' list and watch answers by the version asked for: each scripted watch answers once and then
ends (as the server ends one at its timeoutSeconds), and a request nothing was scripted for is
answered with an error, so that a client asking from the wrong version fails at once instead of
waiting.
"""

from __future__ import annotations

import itertools

import pytest

from kubetune.kubeapi import ClusterError, Gone, Listed, WatchEvent

kmock = pytest.importorskip("kmock")

from tests.kit.kube import KmockServer  # noqa: E402

PODS = kmock.resource("v1", "pods")


def expired() -> Exception:
    """The API server's answer to a watch from a version it no longer holds (kmock sends it as a Status)."""
    return kmock.KubernetesError(status=410, reason="Expired", message="too old resource version")


def unscripted() -> Exception:
    """The answer to a request the test did not expect (a watch from the wrong version, a list too many)."""
    return kmock.KubernetesError(status=500, reason="Unscripted", message="nothing scripted for this request")


def pod(name: str, version: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "resourceVersion": str(version)}}


def event(kind: str, obj: dict) -> dict:
    return {"type": kind, "object": obj}


def bookmark(version: int) -> dict:
    return event("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(version)}})


def status_event(code: int, reason: str) -> dict:
    """An ERROR event: what the server streams when a watch cannot go on."""
    return event("ERROR", {"kind": "Status", "apiVersion": "v1", "code": code, "reason": reason, "message": reason})


class ScriptedPods:
    """The pods' answers: `lists` in turn, `watches` by the resourceVersion asked for (each once)."""

    def __init__(self, server: KmockServer):
        self.lists: list[dict] = []
        self.watches: dict[str, object] = {}
        self.watched_from: list[str] = []
        self.listed = 0
        server.emulator[kmock.action.LIST, PODS] << self._list
        server.emulator[kmock.action.WATCH, PODS] << self._watch

    def _list(self):
        self.listed += 1
        return self.lists.pop(0) if self.lists else unscripted()

    def _watch(self, request):
        version = request.params.get("resourceVersion", "")
        self.watched_from.append(version)
        answer = self.watches.pop(version, unscripted())
        if isinstance(answer, Exception):
            raise answer  # kmock answers it as a Status with its code
        return answer


def listing(version: int, *items: dict) -> dict:
    return {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(version)}, "items": list(items)}


@pytest.fixture
def server():
    s = KmockServer(("v1/pods",))
    yield s
    s.stop()


@pytest.fixture
def pods(server) -> ScriptedPods:
    return ScriptedPods(server)


def take(server: KmockServer, n: int) -> list:
    events = server.client().watch("v1", "Pod", timeout_seconds=5)
    try:
        return list(itertools.islice(events, n))
    finally:
        events.close()


def test_events_come_in_order_and_each_watch_resumes_where_the_last_ended(server, pods):
    a1, b2 = pod("a", 1), pod("b", 2)
    pods.lists = [listing(2, a1, b2)]
    pods.watches = {
        "2": (event("ADDED", pod("c", 3)), event("MODIFIED", pod("a", 4))),  # then the server ends it
        "4": (bookmark(7),),  # nothing changed, but the version moved on
        "7": (event("DELETED", pod("b", 8)), event("ADDED", pod("d", 9))),
    }
    assert take(server, 5) == [
        Listed([a1, b2], "2"),
        WatchEvent("ADDED", pod("c", 3)),
        WatchEvent("MODIFIED", pod("a", 4)),
        WatchEvent("DELETED", pod("b", 8)),
        WatchEvent("ADDED", pod("d", 9)),
    ]
    assert pods.watched_from == ["2", "4", "7"] and pods.listed == 1
    (first, *_) = server.emulator[kmock.action.WATCH]
    assert first.params["timeoutSeconds"] == "5" and first.params["allowWatchBookmarks"] == "true"


@pytest.mark.parametrize(
    "gone",
    [(status_event(410, "Expired"),), expired()],
    ids=["an ERROR event in the stream", "the watch answered 410"],
)
def test_a_version_the_server_no_longer_holds_means_listing_again(server, pods, gone):
    a1, b2 = pod("a", 1), pod("b", 2)
    pods.lists = [listing(2, a1, b2), listing(9, a1, pod("c", 9))]  # b went while the watch was away
    pods.watches = {"2": (event("ADDED", pod("c", 3)),), "3": gone, "9": (event("MODIFIED", pod("a", 10)),)}
    assert take(server, 4) == [
        Listed([a1, b2], "2"),
        WatchEvent("ADDED", pod("c", 3)),
        Listed([a1, pod("c", 9)], "9"),
        WatchEvent("MODIFIED", pod("a", 10)),
    ]
    assert pods.watched_from == ["2", "3", "9"] and pods.listed == 2


@pytest.mark.parametrize(
    "answer,error,message",
    [
        ((status_event(410, "Expired"),), Gone, "watch pods: gone"),  # no event since the list: not again and again
        (expired(), Gone, "watch pods: gone"),
        ((status_event(500, "InternalError"),), ClusterError, "watch pods: the API server answered 500"),
    ],
    ids=["410 right after the list", "410 answer right after the list", "another error"],
)
def test_other_errors_and_a_410_right_after_the_list_are_raised(server, pods, answer, error, message):
    pods.lists = [listing(2, pod("a", 1))]
    pods.watches = {"2": answer}
    with pytest.raises(error, match=message):
        take(server, 3)
    assert pods.listed == 1
