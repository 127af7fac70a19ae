"""A stand-in for `kubetune.kubeapi.KubeClient`, the project's own API boundary.

It holds objects in a dict and answers only what a test scripted: a log or exec nobody
scripted, or any method KubeClient does not have, fails the test at once (kopf's rule:
unexpected calls fail loudly). `calls` records every call for assertions.
"""

from __future__ import annotations

import copy

from kubetune.kubeapi import ClusterError, KubeClient
from kubetune.kubeapi.client import _subset


class UnexpectedCall(AssertionError):
    pass


class FakeClient:
    def __init__(self, objects=(), logs=None, execs=None, forbidden=()):
        self.objects = {}
        for obj in objects:
            self._put(obj)
        self.logs = dict(logs or {})  # pod name -> text
        self.execs = dict(execs or {})  # (pod, tuple(command)) -> bytes on stdout
        self.forbidden = set(forbidden)  # kinds whose reads answer 403
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        raise UnexpectedCall(f"KubeClient has no `{name}`; the code under test called it")

    @staticmethod
    def _key(api_version, kind, name, namespace):
        return (api_version, kind, namespace, name)

    def _put(self, obj):
        meta = obj["metadata"]
        self.objects[self._key(obj["apiVersion"], obj["kind"], meta["name"], meta.get("namespace"))] = copy.deepcopy(
            obj
        )

    def get(self, api_version, kind, name, namespace=None):
        self.calls.append(("get", kind, name))
        if kind in self.forbidden:
            raise ClusterError(f"get {kind} {name}: forbidden")
        return copy.deepcopy(self.objects.get(self._key(api_version, kind, name, namespace)))

    def create(self, obj):
        self.calls.append(("create", obj["kind"], obj["metadata"]["name"]))
        self._put(obj)
        return obj

    def patch(self, obj):
        self.calls.append(("patch", obj["kind"], obj["metadata"]["name"]))
        self._put(obj)
        return obj

    def delete(self, api_version, kind, name, namespace=None):
        self.calls.append(("delete", kind, name))
        return self.objects.pop(self._key(api_version, kind, name, namespace), None) is not None

    def list(self, api_version, kind, namespace=None, labels=None):
        self.calls.append(("list", kind))
        return [
            copy.deepcopy(o)
            for (av, k, ns, _), o in self.objects.items()
            if (av, k) == (api_version, kind)
            and namespace in (None, ns)
            and _subset(labels or {}, o["metadata"].get("labels") or {})
        ]

    apply = KubeClient.apply  # the real create-or-patch decision, over this fake's get/create/patch

    def pod_log(self, pod, namespace, container=None, tail_lines=None, follow=False):
        self.calls.append(("pod_log", pod, container))
        if pod not in self.logs:
            raise UnexpectedCall(f"nobody scripted the log of pod {pod}")
        lines = self.logs[pod].splitlines()
        return iter(lines[-tail_lines:] if tail_lines else lines)

    def exec_to(self, pod, namespace, command, sink, container=None):
        self.calls.append(("exec", pod, tuple(command)))
        key = (pod, tuple(command))
        if key not in self.execs:
            raise UnexpectedCall(f"nobody scripted exec {command} in {pod}")
        result = self.execs[key]
        if isinstance(result, Exception):
            raise result
        sink.write(result)
        return ""
