"""The settings of a serving instance: the command line of `render-serve` and `submit --serve`,
defaults applied, and the problems of a value one line each. Light (no recipe, no renderers): the
CLI builds its options from it at start."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubetune import flags
from kubetune.contracts.serving import Adapter, parse_adapter
from kubetune.flags import Option, is_given, options_of, setting

ENGINES = ("native", "vllm")  # `auto` picks by what is installed, which a manifest cannot know


def default_engine(profile: str) -> str:
    """The engine that uses what the profile's pods hold: vLLM on accelerators (the native
    engine runs on CPUs and would leave the cards idle), the native engine on CPUs."""
    return "native" if profile == "cpu" else "vllm"


AUTOSCALE = ("queue", "cpu", "off")

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def _setting(default: Any, flag: str, help: str, **spec: Any) -> Any:
    """A serving setting: its flag of `render-serve` and `submit --serve` with the flag's help and,
    for a setting a FineTune takes too, its key under `spec.serve` (`kubetune.flags.Option`)."""
    return setting(default, flag, help, **spec)


@dataclass(frozen=True)
class ServeSettings:
    """The settings of a serving instance, defaults applied: each field's Option makes its flag
    (`kubetune.flags.with_options`, in `kubetune.k8s.cli`) and, where it has a spec_key, the FineTune's `spec.serve` key
    (`kubetune.operator.crd`, `kubetune.operator.plan`). A new setting is one field here."""

    engine: str | None = _setting(  # None = the profile's (`default_engine`)
        None,
        "--engine",
        "native (kubetune serve, on CPUs) | vllm (vLLM's image); default: vllm where the pods hold accelerators "
        "(gaudi, nvidia), native on cpu.",
        spec_key="engine",
        spec_help="native (kubetune serve, on CPUs) | vllm (default: vllm on gaudi and nvidia, native on cpu).",
        choices=ENGINES,
    )
    replicas: int = _setting(
        1,
        "--replicas",
        "Pods (default 1); with autoscaling the least the HPA keeps (--min-replicas).",
        spec_key="replicas",
        spec_help="Server pods (default 1).",
        minimum=1,
    )
    min_replicas: int | None = _setting(  # None = replicas
        None,
        "--min-replicas",
        "HPA minReplicas (default --replicas).",
        spec_key="minReplicas",
        spec_help="Autoscaling lower bound (default replicas).",
        minimum=1,
    )
    max_replicas: int | None = _setting(  # None = max(4, min)
        None,
        "--max-replicas",
        "HPA maxReplicas (default max(4, min)).",
        spec_key="maxReplicas",
        spec_help="Autoscaling upper bound (default max(4, minReplicas)).",
        minimum=1,
    )
    adapters: tuple[Adapter, ...] = _setting(
        (),
        "--adapter",
        "NAME=RUN_DIR: also serve that run's LoRA adapter as model NAME (repeatable; a relative RUN_DIR is "
        "under the volume's root, e.g. runs/cardio = /data/runs/cardio).",
    )
    max_loras: int | None = _setting(  # None = every adapter in the layers (kubetune serve fuses them at start)
        None,
        "--max-loras",
        "Adapters in the server's layers at once; more stay registered and load for their requests, evicting the "
        "least recently used idle one (kubetune serve --max-loras, vLLM --max-loras).",
        minimum=1,
    )
    image: str | None = _setting(  # None = kubetune's (native) or vLLM's (vllm) for the profile
        None,
        "--image",
        "The server's image (default: kubetune's for the profile, or vLLM's with --engine vllm).",
        spec_key="image",
        spec_help="The server's image (default kubetune's, or vLLM's for engine vllm).",
    )
    model_image: str | None = _setting(
        None,
        "--model-image",
        "Read the run directory from this image (at /model) instead of the training job's volume claim.",
    )
    name: str | None = _setting(None, "--name", "Name of the serving objects (default <job>-serve).")
    ingress_host: str | None = _setting(
        None,
        "--ingress-host",
        "The Ingress's host, e.g. llm.example.com.",
        spec_key="ingressHost",
        spec_help="The Ingress host (default: any host of the ingress class).",
    )
    ingress_class: str = _setting("nginx", "--ingress-class", "ingressClassName (default nginx).")
    autoscale: str = _setting(
        "queue",
        "--autoscale",
        "queue (waiting requests per pod through prometheus-adapter, CPU as fallback; default) | cpu | off.",
        spec_key="autoscale",
        spec_help="queue (waiting requests) | cpu | off (default queue).",
        choices=AUTOSCALE,
    )
    queue_target: int = _setting(2, "--queue-target", "Waiting requests per pod the HPA aims at (default 2).")
    cpu_target: int = _setting(
        80, "--cpu-target", "CPU utilisation (percent of the request) the HPA aims at (default 80)."
    )
    api_key_secret: str | None = _setting(  # None = an open API
        None,
        "--api-key-secret",
        "An existing Secret whose key `api-key` holds the server's API key (several: comma-separated; vLLM takes "
        "one); every route but the probes and /metrics then needs `Authorization: Bearer KEY`.",
    )
    # off where the cluster's policies are managed elsewhere
    network_policy: bool = _setting(True, "--no-network-policy", "Render no NetworkPolicy for the server.")
    ingress_namespace: str = _setting(
        "ingress-nginx",
        "--ingress-namespace",
        "The ingress controller's namespace, let in by the NetworkPolicy (default ingress-nginx).",
    )
    monitoring_namespace: str = _setting(
        "monitoring",
        "--monitoring-namespace",
        "Prometheus's namespace, let in by the NetworkPolicy for /metrics (default monitoring).",
    )
    ingress_tls_secret: str | None = _setting(
        None, "--ingress-tls-secret", "TLS on the Ingress from this kubernetes.io/tls Secret (needs --ingress-host)."
    )
    cert_manager_issuer: str | None = _setting(
        None,
        "--cert-manager-issuer",
        "TLS on the Ingress from this cert-manager ClusterIssuer, into the Secret <name>-tls (needs --ingress-host).",
    )
    gateway: bool = _setting(
        False,
        "--gateway",
        "Also render an InferencePool over the server's pods and one InferenceObjective per served model "
        "(the run's, each --adapter's), for an Inference Gateway or llm-d's router (docs/serving.md).",
    )
    require_cpu_features: bool = _setting(
        False,
        "--require-cpu-features",
        "cpu: schedule only on nodes with k8s.amx_label (default: preferred, other nodes run fp32).",
    )

    @classmethod
    def from_flags(cls, given: Mapping[str, Any]) -> ServeSettings:
        """Field -> the value of its flag (None, or False for a switch, where not given) -> settings."""
        values: dict[str, Any] = {}
        for f, _ in setting_options():
            value: Any = given.get(f.name)
            if not is_given(value):
                continue
            if f.name == "adapters":
                value = tuple(parse_adapter(a) for a in value)
            elif value is True:
                value = not f.default  # a switch turns its setting away from the default
            values[f.name] = value
        return cls(**values)

    @classmethod
    def from_spec(cls, serve: Mapping[str, Any]) -> ServeSettings:
        """A FineTune's `spec.serve` (its spec keys; `enabled` is the operator's) -> settings."""
        return cls(**{f.name: serve[o.spec_key] for f, o in setting_options() if o.spec_key and o.spec_key in serve})

    def replica_range(self) -> tuple[int, int]:
        lo = self.min_replicas if self.min_replicas is not None else self.replicas
        hi = self.max_replicas if self.max_replicas is not None else max(4, lo)
        return lo, hi

    def problems(self) -> list[str]:
        out = []
        if self.engine is not None and self.engine not in ENGINES:
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
        if self.max_loras is not None and self.max_loras < 1:
            out.append(f"--max-loras {self.max_loras}: adapters in the layers at once, at least 1")
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


def setting_options() -> list[tuple[dataclasses.Field[Any], Option]]:
    """Every setting's field with its Option, in the order of the command line."""
    return options_of(ServeSettings)


def scalar_type(f: dataclasses.Field[Any]) -> type:
    """What a setting holds, None aside: bool, int, str, or tuple (the adapters)."""
    return flags.scalar_type(ServeSettings, f)


def flags_given(given: Mapping[str, Any]) -> list[str]:
    """The flags given (`from_flags`' input), in the order of the command line."""
    return [o.flag for f, o in setting_options() if is_given(given.get(f.name))]


def spec_given(given: Mapping[str, Any]) -> dict[str, Any]:
    """The flags given that a FineTune's `spec.serve` takes, as its keys."""
    return {o.spec_key: given[f.name] for f, o in setting_options() if o.spec_key and given.get(f.name) is not None}


# what `submit --via-operator --serve` maps to a FineTune's spec.serve (the others are render-serve's only)
FINETUNE_FLAGS = {o.flag: o.spec_key for _, o in setting_options() if o.spec_key}
