"""Exposition texts the replay exporter serves, one function per exporter, each a function of the
scrape count `n` (gauges move, counters grow, so rate() and histogram_quantile() have data).

Where the formats come from:
- DCGM exporter: metric names, `# HELP` texts and types from NVIDIA/dcgm-exporter's
  `etc/default-counters.csv` (the default collectors); the label set (gpu, UUID, pci_bus_id,
  device, modelName, Hostname, DCGM_FI_DRIVER_VERSION, and container/namespace/pod with the
  kubelet pod-resources mapping) as dcgm-exporter 3.x/4.x prints it on Kubernetes (its README
  and users' published scrapes). FB_* are MiB, POWER_USAGE watts.
- Intel Gaudi metric exporter: names, `# HELP` texts and types (all gauges) from the exporter's
  metric metadata table in Intel's source (habanalabs_utilization "Utilization of the device",
  habanalabs_memory_used_bytes "Current used bytes of memory", habanalabs_power_mW "Power usage
  in milli-watts", ...) and docs.habana.ai "Prometheus Metric Exporter" (port 41611). Intel
  publishes no full label table; the samples carry the card's `UUID`, which is all the
  dashboards use besides Prometheus's `instance`.
- node-exporter and cAdvisor: the names, help texts and labels node-exporter 1.x and the
  kubelet's /metrics/cadvisor print (node_cpu_seconds_total{cpu,mode}, MemAvailable/MemTotal,
  network by device; container_* with container, cpu, id, image, name, namespace, pod).
The values are representative of a Gaudi2 / H100 training node under load, written by hand:
no accelerator was available to record them (NOTE for readers of the PNGs: not measurements).

kubetune's own series come from the code that serves them where it is importable without
torch (`kubetune.serve.native.metrics.ServeMetrics`, the device plugin's `PluginMetrics`) and from the
contract (`kubetune.contracts.metrics`) for training and the extender.
"""

from __future__ import annotations

import math
import time

from prometheus_client import CollectorRegistry, generate_latest

from kubetune.cluster.deviceplugin.metrics import PluginMetrics
from kubetune.contracts.metrics import STEP_PHASES, TRAIN_METRICS, component_metric, instrument, size_bucket
from kubetune.serve.native.metrics import ServeMetrics

MIB = 1 << 20


def _family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> str:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{{{labels}}} {value:.12g}" for labels, value in samples]
    return "\n".join(lines) + "\n"


def _wave(n: int, base: float, amplitude: float, phase: float = 0.0) -> float:
    return base + amplitude * math.sin(n / 3 + phase)


# ---------------------------------------------------------------------------------- NVIDIA DCGM

_H100 = [
    ("0", "GPU-5d3a8f2c-1b4e-7a90-c2d1-8e6f0a3b9c17", "00000000:18:00.0"),
    ("1", "GPU-a71c0e94-3f28-4d6b-9e05-17c4b2d8f630", "00000000:2A:00.0"),
]


def _dcgm_labels(gpu: str, uuid: str, bus: str) -> str:
    return (
        f'gpu="{gpu}",UUID="{uuid}",pci_bus_id="{bus}",device="nvidia{gpu}",modelName="NVIDIA H100 80GB HBM3",'
        'Hostname="gpu-node-1",DCGM_FI_DRIVER_VERSION="550.90.07",container="pytorch",namespace="kubetune",'
        'pod="demo-master-0"'
    )


def dcgm(n: int) -> str:
    used = [(_dcgm_labels(*g), round(_wave(n, 61000, 900, i))) for i, g in enumerate(_H100)]
    total = 81559  # MiB, an H100 80GB as DCGM reports it
    families = [
        ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).",
         [(_dcgm_labels(*g), 64 + i) for i, g in enumerate(_H100)]),
        ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).",
         [(_dcgm_labels(*g), round(_wave(n, 610, 40, i), 3)) for i, g in enumerate(_H100)]),
        ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).",
         [(_dcgm_labels(*g), round(_wave(n, 88, 8, i))) for i, g in enumerate(_H100)]),
        ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", [(lb, total - v) for lb, v in used]),
        ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", used),
    ]  # fmt: skip
    return "".join(_family(*f) for f in families)


# ---------------------------------------------------------------------------------- Intel Gaudi

_GAUDI2 = ["01P0-HL2080A0-15-TNPS04-19-05-12", "01P0-HL2080A0-15-TNPS04-21-07-03"]
_GAUDI_MEMORY = 96 * 1024 * MIB  # a Gaudi2's HBM


def gaudi(n: int) -> str:
    def per_card(value) -> list[tuple[str, float]]:
        return [(f'UUID="{uuid}"', value(i)) for i, uuid in enumerate(_GAUDI2)]

    families = [
        ("habanalabs_memory_used_bytes", "Current used bytes of memory",
         per_card(lambda i: round(_wave(n, 0.7, 0.05, i) * _GAUDI_MEMORY))),
        ("habanalabs_memory_total_bytes", "Current total bytes of memory", per_card(lambda i: _GAUDI_MEMORY)),
        ("habanalabs_temperature_onchip", "Chip temperature in celsius", per_card(lambda i: 48 + i)),
        ("habanalabs_power_mW", "Power usage in milli-watts", per_card(lambda i: round(_wave(n, 410000, 25000, i)))),
        ("habanalabs_utilization", "Utilization of the device", per_card(lambda i: round(_wave(n, 83, 10, i)))),
    ]  # fmt: skip
    return "".join(_family(name, "gauge", help_text, samples) for name, help_text, samples in families)


# ---------------------------------------------------------------------------------- node-exporter, cAdvisor


def node_exporter(n: int) -> str:
    modes = {"idle": 0.25, "user": 0.6, "system": 0.15}  # seconds per second per CPU
    cpu = [(f'cpu="{c}",mode="{m}"', round(1000 + n * share, 2)) for c in range(2) for m, share in modes.items()]
    total = 512 * 1024 * MIB
    families = [
        ("node_cpu_seconds_total", "counter", "Seconds the CPUs spent in each mode.", cpu),
        ("node_memory_MemAvailable_bytes", "gauge", "Memory information field MemAvailable_bytes.",
         [("", round(_wave(n, 0.45, 0.05) * total))]),
        ("node_memory_MemTotal_bytes", "gauge", "Memory information field MemTotal_bytes.", [("", total)]),
        ("node_network_receive_bytes_total", "counter", "Network device statistic receive_bytes.",
         [('device="eth0"', 5e9 + n * 2.4e9), ('device="lo"', 1e6 + n * 1e3)]),
        ("node_network_transmit_bytes_total", "counter", "Network device statistic transmit_bytes.",
         [('device="eth0"', 4e9 + n * 2.3e9), ('device="lo"', 1e6 + n * 1e3)]),
    ]  # fmt: skip
    text = "".join(_family(*f) for f in families)
    return text.replace("{}", "")  # node-exporter prints label-less samples without braces


def cadvisor(n: int) -> str:
    pods = [("demo-master-0", "pytorch", 14.5), ("demo-worker-0", "pytorch", 13.8)]
    labels = [
        f'container="{c}",cpu="total",id="/kubepods/pod{i}/{c}",image="ghcr.io/kubetune/kubetune:0.1.0",'
        f'name="{p}_{c}",namespace="kubetune",pod="{p}"'
        for i, (p, c, _) in enumerate(pods)
    ]
    cpu = [(lb, round(100 + n * cores, 3)) for lb, (_, _, cores) in zip(labels, pods)]
    memory = [(lb.replace('cpu="total",', ""), round(_wave(n, 180e9, 5e9, i))) for i, lb in enumerate(labels)]
    return _family(
        "container_cpu_usage_seconds_total", "counter", "Cumulative cpu time consumed in seconds.", cpu
    ) + _family("container_memory_working_set_bytes", "gauge", "Current working set in bytes.", memory)


# ---------------------------------------------------------------------------------- kubetune


class Training:
    """Two ranks of job `demo` on node `node-a`, labelled as kubetune.training.telemetry labels them."""

    def __init__(self, job: str = "demo", ranks: int = 2) -> None:
        self.registry = CollectorRegistry()
        self.ranks = [(job, str(r), "node-a") for r in range(ranks)]
        self.metrics = {m.name: instrument(m, self.registry) for m in TRAIN_METRICS}

    def __call__(self, n: int) -> str:
        for job, rank, node in self.ranks:
            self._step(n, (job, rank, node))
        return generate_latest(self.registry).decode()

    def _step(self, n: int, who: tuple[str, str, str]) -> None:
        m, total = self.metrics, 1000
        gauges = {
            "kubetune_train_step": n, "kubetune_train_total_steps": total, "kubetune_train_epoch": n / 250,
            "kubetune_train_progress_ratio": n / total, "kubetune_train_eta_seconds": (total - n) * 1.2,
            "kubetune_train_loss": 2.5 / (1 + n / 20), "kubetune_train_eval_loss": 2.7 / (1 + n / 20),
            "kubetune_train_learning_rate": 2e-4, "kubetune_train_grad_norm": 0.8,
            "kubetune_train_tokens_per_second": 4100, "kubetune_train_mfu_ratio": 0.41,
            "kubetune_train_memory_bytes": 150e9, "kubetune_train_memory_budget_bytes": 200e9,
            "kubetune_checkpoint_last_timestamp_seconds": 1.7e9,
        }  # fmt: skip
        for name, value in gauges.items():
            m[name].labels(*who).set(value)
        # a DPO job's TRL metrics (an SFT job exports none; the dashboard's Preference row reads them)
        preference = {
            "rewards/accuracies": 0.5 + n / 2000, "eval_rewards/accuracies": 0.45 + n / 2000,
            "rewards/chosen": 0.01 * n / 20, "rewards/rejected": -0.01 * n / 20, "rewards/margins": 0.02 * n / 20,
        }  # fmt: skip
        for metric, value in preference.items():
            m["kubetune_train_preference"].labels(*who, metric).set(value)
        # and a GRPO job's (the Online RL row reads them)
        rl = {
            "reward": 0.2 + n / 200, "eval_reward": 0.15 + n / 200, "eval_accuracy": 0.1 + n / 200, "kl": 0.01,
            "entropy": 1.2, "clip_ratio/region_mean": 0.02, "completions/mean_length": 40.0,
            "completions/clipped_ratio": 0.1, "frac_reward_zero_std": 0.3,
        }  # fmt: skip
        for metric, value in rl.items():
            m["kubetune_train_rl"].labels(*who, metric).set(value)
        m["kubetune_train_tokens_total"].labels(*who).inc(4900)
        m["kubetune_train_nonfinite_steps_total"].labels(*who).inc(0)
        m["kubetune_train_restarts_total"].labels(*who).inc(0)
        m["kubetune_checkpoint_seconds"].labels(*who).observe(4.2)
        for phase, seconds in zip(STEP_PHASES, (0.02, 0.0, 0.9, 0.2, 0.05)):
            m["kubetune_train_step_seconds"].labels(*who, phase).observe(seconds)
        for op, size, seconds in (("all_reduce", 1 << 24, 0.012), ("all_gather", 1 << 20, 0.002)):
            m["kubetune_collective_seconds"].labels(*who, op, size_bucket(size)).observe(seconds)
            m["kubetune_collective_bytes_total"].labels(*who, op).inc(size)


class _Seq:
    """What ServeMetrics reads of a sequence: its request (adapter, a 40-token prompt, arrival
    1.2 s ago), when it left the queue, its last token's time and how many it generated."""

    def __init__(self, adapter: str | None) -> None:
        arrival = time.monotonic() - 1.2
        self.request = type("Request", (), {"adapter_name": adapter, "arrival": arrival, "prompt": [0] * 40})()
        self.started: float | None = arrival + 0.01
        self.last_token: float | None = None
        self.generated = 0


class Serving:
    """`kubetune serve`'s own metrics object, fed a few requests per scrape."""

    def __init__(self, model: str = "smollm2-135m") -> None:
        self.metrics = ServeMetrics(model, max_lora=2, adapter_names=["cardio"])

    def __call__(self, n: int) -> str:
        m = self.metrics
        for _ in range(3):
            seq = _Seq(None)
            m.prefix_lookup(40, 32)
            for i in range(6):  # the first token 80 ms after arrival, then one every 20 ms
                now = seq.request.arrival + 0.08 + 0.02 * i
                (m.first_token if seq.last_token is None else m.inter_token)(seq, now)
                seq.last_token, seq.generated = now, seq.generated + 1
            m.finished(seq, "stop")
        m.state(2, 1, 0.3, [_Seq("cardio")], [_Seq(None)])  # a steady queue: no alert may pend
        m.adapter_loaded(0.02)  # --max-loras: an adapter swapped into the layers each scrape
        m.adapter_evicted()
        m.adapters_resident(2)
        return generate_latest(m.registry).decode()


class DevicePlugin:
    """The device plugin's own metrics object, as a node with 8 Gaudi cards updates it."""

    def __init__(self) -> None:
        self.plugin = PluginMetrics()

    def __call__(self, n: int) -> str:
        resource = "habana.ai/gaudi"
        self.plugin.set_health(resource, {f"card{i}": "Healthy" for i in range(8)})
        self.plugin.driver_present.labels(resource).set(1)
        self.plugin.allocations.labels(resource).inc()
        self.plugin.allocated_devices.labels(resource).inc(4)
        self.plugin.allocate_errors.labels(resource).inc(0)
        self.plugin.registrations.labels(resource).inc(1 if n == 1 else 0)
        return generate_latest(self.plugin.registry).decode()


class Extender:
    """The scheduler extender's latency histogram, named and labelled as its app does."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        latency = component_metric("kubetune_extender_request_seconds")
        self.latency = instrument(latency, self.registry)

    def __call__(self, n: int) -> str:
        for verb in ("filter", "prioritize"):
            self.latency.labels(verb, "200").observe(0.003)
        return generate_latest(self.registry).decode()


def routes() -> dict:
    """Path -> exposition text of the scrape number n, for ReplayExporter."""
    return {
        "/dcgm": dcgm,
        "/gaudi": gaudi,
        "/node": node_exporter,
        "/cadvisor": cadvisor,
        "/training": Training(),
        "/serving": Serving(),
        "/deviceplugin": DevicePlugin(),
        "/extender": Extender(),
    }
