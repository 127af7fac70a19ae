"""`KubeClient`: every call kubetune makes to a Kubernetes API server, on plain dicts.

get / create / patch / delete / list any kind of `kinds.KINDS`, a JSON patch, pod logs, exec
(for copying files out of the data-access pod), and `watch` (list, then follow changes, as
client-go's reflector does). Objects are dicts in the shape the API server takes. The job
commands, the operator, `kubetune monitor` and the cluster components all talk through it;
tests swap this boundary for a fake, or point it at kmock's emulated API server.

Errors become `ClusterError` (a UserError: one line, exit 2): no configuration, unreachable
server, 401/403, missing CRDs; `NotFound` (404), `Conflict` (409) and `Gone` (410) are
subclasses a caller may handle. `get` returns None on 404, `list` an empty list.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Iterator, Sequence
from typing import IO, Any

from kubetune.kubeapi.config import ClusterError, load_config
from kubetune.kubeapi.kinds import KINDS, Kind, api_path, kind_of
from kubetune.kubeapi.watch import Listed, WatchEvent, resource_version

__all__ = ["Conflict", "Gone", "KubeClient", "NotFound", "connect"]

# A watch that has said nothing for this much longer than the timeoutSeconds it asked for is
# over: the server (or a proxy on the way) dropped it without closing the connection.
WATCH_READ_GRACE_SECONDS = 30


class NotFound(ClusterError):
    pass


class Conflict(ClusterError):
    """409: the object already exists (create) or changed meanwhile."""


class Gone(ClusterError):
    """410: the resourceVersion a watch asked for is older than the server still holds."""


def connect() -> KubeClient:
    """The client the CLI uses (tests replace this function or point KUBECONFIG elsewhere)."""
    return KubeClient(load_config())


def _subset(want, have) -> bool:
    """True when every field of `want` is present and equal in `have` (server adds defaults)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(map(_subset, want, have))
    return want == have


def _field(obj: dict, dotted: str) -> Any:
    """`spec.nodeName` of `obj`, None where a step is missing."""
    value: Any = obj
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _selector(pairs: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in pairs.items())


def _status_error(code: int, reason: str, message: str, what: str) -> ClusterError:
    """An API answer that is not a success (an HTTP status, or a watch's ERROR event), as the error to raise."""
    if code == 404:
        return NotFound(f"{what}: not found ({message})")
    if code == 409:
        return Conflict(f"{what}: conflict ({message})")
    if code == 410:
        return Gone(f"{what}: gone ({message})")
    if code in (401, 403):
        return ClusterError(
            f"{what}: {'forbidden' if code == 403 else 'unauthorized'} ({message}); "
            "check your kubeconfig user and its RBAC permissions in this namespace"
        )
    return ClusterError(f"{what}: the API server answered {code} {reason} ({message})")


class KubeClient:
    def __init__(self, configuration=None):
        from kubernetes import client

        self._api = client.ApiClient(configuration or load_config())
        self.host = self._api.configuration.host

    # ------------------------------------------------------------------ the one HTTP funnel
    def _call(
        self,
        method: str,
        path: str,
        *,
        body=None,
        query=None,
        content_type="application/json",
        what: str = "",
        preload: bool = True,
        read_timeout: float | None = 60,
    ):
        """One request; the decoded JSON answer, or with preload=False the open response to stream."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            return self._api.call_api(
                path,
                method,
                query_params=list((query or {}).items()),
                header_params=headers,
                body=body,
                response_type="object" if preload else None,
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _preload_content=preload,
                _request_timeout=(10, read_timeout),
            )
        except ApiException as e:
            raise self._api_error(e, what or f"{method} {path}") from None
        except HTTPError as e:
            raise ClusterError(f"cannot reach the Kubernetes API at {self.host}: {type(e).__name__}: {e}") from None

    def _api_error(self, e, what: str) -> ClusterError:
        try:
            message = json.loads(e.body or "{}").get("message") or e.reason
        except (ValueError, AttributeError):
            message = e.reason
        return _status_error(e.status, e.reason, message, what)

    def _lines(self, response, what: str) -> Iterator[bytes]:
        """A streamed answer (a log, a watch) line by line, until the server ends it. A read
        timeout ends it too; a connection that breaks is a ClusterError."""
        from urllib3.exceptions import HTTPError, ReadTimeoutError

        pending = b""
        try:
            for chunk in response.stream(4096):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                yield from lines
        except ReadTimeoutError:
            return
        except HTTPError as e:
            raise ClusterError(f"{what}: the connection to {self.host} broke off: {type(e).__name__}: {e}") from None
        finally:  # closed, not only released: a stream left half read must not serve the next request
            response.close()
            response.release_conn()
        if pending:
            yield pending

    # ------------------------------------------------------------------ objects
    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict | None:
        k = kind_of(api_version, kind)
        try:
            return self._call("GET", api_path(k, namespace, name), what=f"get {kind} {name}")
        except NotFound:
            return None

    def create(self, obj: dict) -> dict:
        k = kind_of(obj["apiVersion"], obj["kind"])
        ns = obj["metadata"].get("namespace")
        try:
            return self._call("POST", api_path(k, ns), body=obj, what=f"create {k.kind} {obj['metadata']['name']}")
        except NotFound as e:
            hint = f": is {k.install_hint} installed?" if k.install_hint else ""
            raise NotFound(f"{e}{hint}") from None  # still a ClusterError; submit skips absent monitoring kinds

    def patch(self, obj: dict) -> dict:
        """JSON merge patch with this (partial) object: its fields replace the live ones, maps merge,
        a None removes the key. No resourceVersion, no replace."""
        k = kind_of(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        return self._call(
            "PATCH",
            api_path(k, meta.get("namespace"), meta["name"]),
            body=obj,
            content_type="application/merge-patch+json",
            what=f"update {k.kind} {meta['name']}",
        )

    def json_patch(
        self, api_version: str, kind: str, name: str, operations: list[dict], namespace: str | None = None
    ) -> dict:
        """JSON patch (RFC 6902): for replacing a whole field, where a merge patch would keep the
        keys the new value no longer has."""
        k = kind_of(api_version, kind)
        return self._call(
            "PATCH",
            api_path(k, namespace, name),
            body=operations,
            content_type="application/json-patch+json",
            what=f"update {kind} {name}",
        )

    def patch_status(self, api_version: str, kind: str, name: str, namespace: str | None, status: dict) -> dict:
        """JSON merge patch of the status subresource."""
        k = kind_of(api_version, kind)
        return self._call(
            "PATCH",
            api_path(k, namespace, name) + "/status",
            body={"status": status},
            content_type="application/merge-patch+json",
            what=f"update status of {kind} {name}",
        )

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> bool:
        """Delete (pods of a job go with it: propagation Background); False if it was absent."""
        k = kind_of(api_version, kind)
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            self._call("DELETE", api_path(k, namespace, name), body=body, what=f"delete {kind} {name}")
        except NotFound:
            return False
        return True

    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        labels: dict[str, str] | None = None,
        fields: dict[str, str] | None = None,
    ) -> list[dict]:
        """The objects whose labels and fields (`{"spec.nodeName": "n1"}`) have these values;
        namespace None: every namespace. An unknown resource (no CRD) lists as empty."""
        k = kind_of(api_version, kind)
        query = {}
        if labels:
            query["labelSelector"] = _selector(labels)
        if fields:
            query["fieldSelector"] = _selector(fields)
        try:
            items = self._listed(k, namespace, query).items
        except NotFound:
            return []
        # Filter here too: selectors are a server-side optimisation, not something to trust blindly.
        return [
            o
            for o in items
            if _subset(labels or {}, (o.get("metadata") or {}).get("labels") or {})
            and all(_field(o, path) == value for path, value in (fields or {}).items())
        ]

    def _listed(self, k: Kind, namespace: str | None, query: dict | None = None) -> Listed:
        body = self._call("GET", api_path(k, namespace), query=query, what=f"list {k.plural}")
        return Listed(body.get("items") or [], (body.get("metadata") or {}).get("resourceVersion") or "")

    def apply(self, obj: dict, immutable: bool = False) -> str:
        """Create, or merge-patch when it differs: created | configured | unchanged | kept."""
        meta = obj["metadata"]
        live = self.get(obj["apiVersion"], obj["kind"], meta["name"], meta.get("namespace"))
        if live is None:
            self.create(obj)
            return "created"
        if _subset(obj, live):
            return "unchanged"
        if immutable:
            return "kept"
        self.patch(obj)
        return "configured"

    # ------------------------------------------------------------------ watch
    def watch(
        self, api_version: str, kind: str, namespace: str | None = None, *, timeout_seconds: int = 300
    ) -> Generator[Listed | WatchEvent, None, None]:
        """List, then follow every change from the list's resourceVersion; never ends by itself.

        Yields a `Listed` (every object there is) first, then a `WatchEvent` per change in the
        server's order. Each watch request asks the server to end it after `timeout_seconds`; the
        next resumes from the last resourceVersion seen (an event's object's, or a BOOKMARK's,
        which moves it without a change and is not yielded). When the server no longer holds
        that version (410 Gone, as an ERROR event or as the answer) it lists again and yields a
        fresh `Listed`: what changed meanwhile is in it, deletions as absences. Other errors
        raise ClusterError (a 410 on the first watch after a list too, rather than list again
        and again); the caller starts over by calling watch again.
        """
        k = kind_of(api_version, kind)
        while True:
            listed = self._listed(k, namespace)
            yield listed
            version, first = listed.resource_version, True
            try:
                while True:
                    for event in self._watch_request(k, namespace, version, timeout_seconds):
                        version = resource_version(event) or version
                        if event["type"] != "BOOKMARK":
                            yield WatchEvent(event["type"], event["object"])
                    first = False
            except Gone:
                if first:
                    raise

    def _watch_request(self, k: Kind, namespace: str | None, version: str, timeout_seconds: int) -> Iterator[dict]:
        """One watch request from `version`: its events (bookmarks too) until the server ends it."""
        what = f"watch {k.plural}"
        query = {
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        read_timeout = timeout_seconds + WATCH_READ_GRACE_SECONDS
        response = self._call(
            "GET", api_path(k, namespace), query=query, what=what, preload=False, read_timeout=read_timeout
        )
        for line in self._lines(response, what):
            if not line.strip():
                continue
            event = json.loads(line)
            if event.get("type") == "ERROR":  # a Status: 410 when `version` is too old
                status = event.get("object") or {}
                raise _status_error(status.get("code", 0), status.get("reason", ""), status.get("message", ""), what)
            yield event

    # ------------------------------------------------------------------ pods
    def pod_log(
        self,
        pod: str,
        namespace: str,
        container: str | None = None,
        tail_lines: int | None = None,
        follow: bool = False,
    ) -> Iterator[str]:
        """The container's log, line by line (follows until the container ends with follow=True)."""
        query: dict = {"follow": "true" if follow else "false"}
        if container:
            query["container"] = container
        if tail_lines:
            query["tailLines"] = str(tail_lines)
        what = f"logs of pod {pod}"
        path = api_path(KINDS[("v1", "Pod")], namespace, pod) + "/log"
        response = self._call("GET", path, query=query, what=what, preload=False, read_timeout=None)
        for line in self._lines(response, what):
            yield line.decode("utf-8", "replace")

    def exec_to(
        self, pod: str, namespace: str, command: Sequence[str], sink: IO[bytes], container: str | None = None
    ) -> str:
        """Run `command` in the pod, stdout (binary) into `sink`; returns stderr. Like `kubectl exec`.

        Built on the client's WSClient directly rather than `kubernetes.stream.stream`, which
        always keeps a second in-memory copy of everything received (capture_all): a run
        directory with checkpoints is gigabytes.
        """
        from kubernetes.stream.ws_client import WSClient, get_websocket_url

        query = [("command", command), ("stdout", "true"), ("stderr", "true"), ("stdin", "false"), ("tty", "false")]
        if container:
            query.append(("container", container))
        url = get_websocket_url(self.host + api_path(KINDS[("v1", "Pod")], namespace, pod) + "/exec", query)
        headers = {}
        token = (self._api.configuration.auth_settings().get("BearerToken") or {}).get("value")
        if token:
            headers["authorization"] = token
        try:
            ws = WSClient(self._api.configuration, url, headers, capture_all=False, binary=True)
        except Exception as e:  # websocket handshake errors (403, 404, refused) share no base class
            raise ClusterError(f"exec in pod {namespace}/{pod} failed: {e}") from None
        stderr = b""
        try:
            while ws.is_open():
                ws.update(timeout=1)
                if ws.peek_stdout():
                    sink.write(ws.read_stdout())
                if ws.peek_stderr():
                    stderr += ws.read_stderr()
            code = ws.returncode
        except Exception as e:
            raise ClusterError(f"exec in pod {namespace}/{pod} broke off: {type(e).__name__}: {e}") from None
        finally:
            ws.close()
        if code:
            raise ClusterError(
                f"`{' '.join(command)}` in pod {pod} exited {code}: {stderr.decode(errors='replace').strip()}"
            )
        return stderr.decode(errors="replace")
