"""kmock's in-memory Kubernetes API served over real loopback HTTP, on its own event loop in a
background thread: kubetune reaches it through the real kubernetes client, as it would a cluster.

kmock's sharp edges (see ../shared/reference/kubernetes.md section 9): a resource must be declared
up front, or listing it answers 404 (as for an unknown kind) until its first object exists;
namespaces, logs and selectors are not emulated (the fixtures script them).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Mapping
from typing import Any


class KmockServer:
    """`resources`: "group/version/plural" names, or a mapping of them to kmock.ResourceInfo.
    `objects` ({("v1/nodes", namespace or None, name): object}) are there from the start: kmock's
    create takes longer the more objects it holds, too long for thousands of them one by one."""

    def __init__(
        self,
        resources: Iterable[str] | Mapping[str, Any] = (),
        objects: Mapping[tuple[str, str | None, str], dict] | None = None,
    ):
        import kmock

        self.emulator = kmock.KubernetesEmulator()
        infos = resources if isinstance(resources, Mapping) else {name: {} for name in resources}
        for resource, info in infos.items():
            self.emulator.resources[resource] = info
        for key, obj in (objects or {}).items():
            self.emulator.objects[key] = obj
        self._box: dict = {}
        ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve(ready)), daemon=True)
        self._thread.start()
        assert ready.wait(10), "kmock did not start"
        if "error" in self._box:
            raise self._box["error"]
        self.url: str = self._box["url"]

    async def _serve(self, ready: threading.Event) -> None:
        import kmock

        try:
            async with self.emulator, kmock.Server(self.emulator, host="127.0.0.1") as server:
                stop = asyncio.Event()
                self._box.update(url=str(server.url).rstrip("/"), stop=stop, loop=asyncio.get_running_loop())
                ready.set()
                await stop.wait()
        except BaseException as e:  # a start-up failure surfaces in the test, not as a hang
            self._box["error"] = e
            ready.set()

    def kubeconfig(self, user: str, namespace: str | None = None) -> str:
        """A kubeconfig (YAML) whose current context is this server, as user USER with a token."""
        import yaml

        context = {"cluster": "kmock", "user": user, **({"namespace": namespace} if namespace else {})}
        return yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "kmock",
                "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                "users": [{"name": user, "user": {"token": "not-a-secret"}}],
                "contexts": [{"name": "kmock", "context": context}],
            }
        )

    def client(self):
        """kubetune's `KubeClient` on this server, as the commands and the cluster components use it."""
        from kubernetes.client import Configuration

        from kubetune.kubeapi import KubeClient

        return KubeClient(Configuration(host=self.url))

    def stop(self) -> None:
        if "loop" in self._box:
            self._box["loop"].call_soon_threadsafe(self._box["stop"].set)
        self._thread.join(timeout=5)


def pod_recipe(objects: Iterable[dict]) -> dict:
    """The recipe a rendered job's pods read: the `recipe.yaml` of its ConfigMap."""
    import yaml

    config_map = next(o for o in objects if o["kind"] == "ConfigMap" and "recipe.yaml" in o.get("data", {}))
    return yaml.safe_load(config_map["data"]["recipe.yaml"])
