"""The contract between the device plugin and the scheduler extender: per-node facts on the Node.

The plugin writes these (when its ServiceAccount may patch its own Node); the extender reads
them from the Node objects the kube-scheduler sends it. Every value is a string, as
annotations are. A missing or unparsable value means "unknown" to the extender, which then
scores that part neutrally instead of failing.

Annotations:

- `kubetune.io/resource`: the extended resource the facts describe, e.g. `habana.ai/gaudi`
- `kubetune.io/cards-total`: cards the plugin found on the node
- `kubetune.io/cards-healthy`: of those, healthy now
- `kubetune.io/cards-free`: healthy and not held by a running container (kubelet
  PodResources API); absent when the plugin cannot know
- `kubetune.io/hbm-per-card-mib`: HBM of one card, MiB
- `kubetune.io/hbm-free-mib`: free HBM of each free card (healthy, held by no container), MiB,
  largest first, comma-separated (`131072,131072,98304`; "" = no free card): measured where the
  backend can (NVML), the card's size otherwise; absent when the plugin cannot know
- `kubetune.io/numa-layout`: `numa:healthy/total` per NUMA node, e.g. `0:4/4,1:3/4`
- `kubetune.io/facts-updated`: RFC 3339 time of the last publish

Written by `kubetune netprobe` (cluster/netprobe.py), one per node:

- `kubetune.io/rdma-latency-us`: one-way latency to the other nodes' probers, microseconds:
  the median over the peers that answered (ib_write_lat where RDMA is present, else half the
  TCP round trip over the pod network)
- `kubetune.io/latency-method`: `rdma` | `tcp`, how that figure was measured
- `kubetune.io/latency-peers`: `answered/asked` peers in the last published round
- `kubetune.io/latency-updated`: RFC 3339 time of that round

Labels:

- `kubetune.io/network-leaf`: the network leaf (ToR switch) of the node, copied from a
  configurable node label
- `kubetune.io/accelerator`: card model, e.g. `gaudi3` (usable in nodeSelectors)
"""

from __future__ import annotations

RESOURCE = "kubetune.io/resource"
CARDS_TOTAL = "kubetune.io/cards-total"
CARDS_HEALTHY = "kubetune.io/cards-healthy"
CARDS_FREE = "kubetune.io/cards-free"
HBM_PER_CARD_MIB = "kubetune.io/hbm-per-card-mib"
HBM_FREE_MIB = "kubetune.io/hbm-free-mib"
NUMA_LAYOUT = "kubetune.io/numa-layout"
RDMA_LATENCY_US = "kubetune.io/rdma-latency-us"
FACTS_UPDATED = "kubetune.io/facts-updated"
LATENCY_METHOD = "kubetune.io/latency-method"
LATENCY_PEERS = "kubetune.io/latency-peers"
LATENCY_UPDATED = "kubetune.io/latency-updated"

LEAF_LABEL = "kubetune.io/network-leaf"
ACCELERATOR_LABEL = "kubetune.io/accelerator"

# Pods of one Kubeflow training job carry this label (reference §1); the extender groups by it.
KUBEFLOW_JOB_LABEL = "training.kubeflow.org/job-name"
# Trainer v2 / JobSet pods carry this one instead.
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"

MANAGED_RESOURCES = ("habana.ai/gaudi", "nvidia.com/gpu")
