"""The settings of a serving instance: the command line of `render-serve` and `submit --serve`,
defaults applied, and the problems of a value one line each. Light (no recipe, no renderers): the
CLI builds its options from it at start."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kubetune.serve.contract import Adapter

ENGINES = ("native", "vllm")  # `auto` picks by what is installed, which a manifest cannot know
AUTOSCALE = ("queue", "cpu", "off")

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


@dataclass(frozen=True)
class ServeSettings:
    """The command line of `render-serve` (and `submit --serve`), defaults applied."""

    engine: str = "native"
    replicas: int = 1
    min_replicas: int | None = None  # HPA minReplicas; None = replicas
    max_replicas: int | None = None  # HPA maxReplicas; None = max(4, min)
    adapters: tuple[Adapter, ...] = ()
    image: str | None = None  # the server's image; None = kubetune's (native) or vLLM's (vllm) for the profile
    model_image: str | None = None  # read the run from this image instead of the job's claim
    name: str | None = None
    ingress_host: str | None = None
    ingress_class: str = "nginx"
    autoscale: str = "queue"
    queue_target: int = 2  # waiting requests per pod the HPA aims at
    cpu_target: int = 80  # CPU utilisation (% of the request) the HPA aims at
    api_key_secret: str | None = None  # an existing Secret whose key `api-key` the server requires; None = open
    network_policy: bool = True  # the NetworkPolicy `<name>`; off where the cluster's policies are managed elsewhere
    ingress_namespace: str = "ingress-nginx"  # the ingress controller's namespace (allowed by the NetworkPolicy)
    monitoring_namespace: str = "monitoring"  # Prometheus's namespace (allowed, for /metrics)
    ingress_tls_secret: str | None = None  # TLS on the Ingress from this kubernetes.io/tls Secret
    cert_manager_issuer: str | None = None  # TLS from cert-manager: this ClusterIssuer writes the Secret
    require_cpu_features: bool = False  # cpu: only nodes with k8s.amx_label (else they are preferred)

    def replica_range(self) -> tuple[int, int]:
        lo = self.min_replicas if self.min_replicas is not None else self.replicas
        hi = self.max_replicas if self.max_replicas is not None else max(4, lo)
        return lo, hi

    def problems(self) -> list[str]:
        out = []
        if self.engine not in ENGINES:
            out.append(
                f"--engine {self.engine}: use native or vllm (auto picks by what is installed, "
                "which a manifest cannot know)"
            )
        if self.autoscale not in AUTOSCALE:
            out.append(f"--autoscale {self.autoscale}: use queue, cpu or off")
        lo, hi = self.replica_range()
        if self.replicas < 1 or lo < 1:
            out.append(f"--replicas/--min-replicas must be at least 1 (got {min(self.replicas, lo)})")
        elif hi < lo:
            out.append(f"--max-replicas {hi} is below --min-replicas {lo}")
        if self.queue_target < 1:
            out.append(f"--queue-target {self.queue_target}: waiting requests per pod must be at least 1")
        if not 1 <= self.cpu_target <= 100:
            out.append(f"--cpu-target {self.cpu_target}: a utilisation in percent, 1..100")
        names = [a.name for a in self.adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            out.append(f"--adapter names must be unique (repeated: {', '.join(dupes)})")
        if self.name is not None and (len(self.name) > 63 or not DNS_1035.match(self.name)):
            out.append(
                f"--name {self.name!r}: a Service name is a DNS-1035 label (a lower-case letter first, "
                "then letters, digits or '-', at most 63)"
            )
        if self.ingress_host is not None and not re.fullmatch(r"[a-z0-9*]([-a-z0-9.]*[a-z0-9])?", self.ingress_host):
            out.append(f"--ingress-host {self.ingress_host!r}: a DNS name such as llm.example.com")
        return out + self.access_problems()

    def access_problems(self) -> list[str]:
        """The API key's Secret, the NetworkPolicy's namespaces, the Ingress's TLS."""
        out = []
        for flag, value, pattern, what in (
            ("--api-key-secret", self.api_key_secret, DNS_1123_SUBDOMAIN, "a Secret name"),
            ("--ingress-tls-secret", self.ingress_tls_secret, DNS_1123_SUBDOMAIN, "a Secret name"),
            ("--cert-manager-issuer", self.cert_manager_issuer, DNS_1123_SUBDOMAIN, "a ClusterIssuer name"),
            ("--ingress-namespace", self.ingress_namespace, DNS_1123_LABEL, "a namespace"),
            ("--monitoring-namespace", self.monitoring_namespace, DNS_1123_LABEL, "a namespace"),
        ):
            if value is not None and (
                len(value) > (63 if pattern is DNS_1123_LABEL else 253) or not pattern.match(value)
            ):
                out.append(f"{flag} {value!r}: {what} is lower-case letters, digits and '-' (e.g. llm-serve)")
        if (self.ingress_tls_secret or self.cert_manager_issuer) and not self.ingress_host:
            out.append(
                "--ingress-tls-secret/--cert-manager-issuer: a certificate is for a host; give --ingress-host too"
            )
        return out
