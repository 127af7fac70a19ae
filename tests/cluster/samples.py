"""Realistic kube-scheduler payloads (full v1.Node / v1.Pod JSON) for the tests and the extender's
latency benchmark (bench/cluster/extender_latency.py imports them from this checkout).

The shapes follow what `kubectl get node -o json` shows on a Gaudi node running the
kubetune device plugin: labels, the plugin's annotations, conditions, addresses, nodeInfo,
a list of images, capacity and allocatable. The bulk matters: latency is measured with it.
"""

from __future__ import annotations

import zlib

from kubetune.cluster import nodefacts as keys


def gaudi_node(
    name: str,
    *,
    cards: int = 8,
    free: int | None = 8,
    leaf: str | None = "leaf-00",
    model: str = "gaudi3",
    rdma_latency_us: float | None = 3.1,
    resource: str = "habana.ai/gaudi",
    healthy: int | None = None,
    hbm_free: list[int] | None = None,
) -> dict:
    healthy = cards if healthy is None else healthy
    hbm = {"gaudi2": 96 * 1024, "gaudi3": 128 * 1024}.get(model, 80 * 1024)
    labels = {
        "beta.kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "node.kubernetes.io/instance-type": "hls3" if model == "gaudi3" else "hls2",
        "topology.kubernetes.io/region": "us-west",
        "topology.kubernetes.io/zone": "us-west-1a",
        keys.ACCELERATOR_LABEL: model,
    }
    if leaf is not None:
        labels[keys.LEAF_LABEL] = leaf
    annotations = {
        "node.alpha.kubernetes.io/ttl": "0",
        "volumes.kubernetes.io/controller-managed-attach-detach": "true",
        "kubeadm.alpha.kubernetes.io/cri-socket": "unix:///run/containerd/containerd.sock",
        keys.RESOURCE: resource,
        keys.CARDS_TOTAL: str(cards),
        keys.CARDS_HEALTHY: str(healthy),
        keys.HBM_PER_CARD_MIB: str(hbm),
        keys.NUMA_LAYOUT: f"0:{cards // 2}/{cards // 2},1:{cards - cards // 2}/{cards - cards // 2}",
        keys.FACTS_UPDATED: "2025-06-01T12:00:00Z",
    }
    if free is not None:
        annotations[keys.CARDS_FREE] = str(free)
    if rdma_latency_us is not None:
        annotations[keys.RDMA_LATENCY_US] = str(rdma_latency_us)
    if hbm_free is not None:  # free MiB of each free card, as the plugin publishes it
        annotations[keys.HBM_FREE_MIB] = ",".join(str(v) for v in sorted(hbm_free, reverse=True))
    capacity = {
        "cpu": "224",
        "ephemeral-storage": "3750000000Ki",
        "hugepages-1Gi": "0",
        "hugepages-2Mi": "180Gi",
        "memory": "2113276436Ki",
        "pods": "110",
        resource: str(cards),
    }
    allocatable = dict(capacity, cpu="223", memory="2102790676Ki", **{resource: str(healthy)})
    conditions = [
        {
            "type": t,
            "status": s,
            "lastHeartbeatTime": "2025-06-01T12:00:00Z",
            "lastTransitionTime": "2025-05-01T08:00:00Z",
            "reason": r,
            "message": m,
        }
        for t, s, r, m in (
            ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
        )
    ]
    images = [
        {
            "names": [
                f"vault.habana.ai/gaudi-docker/1.21.0/ubuntu22.04/habanalabs/pytorch-installer-2.6.0@sha256:{i:064x}"
            ],
            "sizeBytes": 9_800_000_000 + i,
        }
        for i in range(6)
    ]
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": f"8c1a5c7e-0000-4000-8000-{zlib.crc32(name.encode()):012d}",
            "resourceVersion": "123456789",
            "creationTimestamp": "2025-05-01T08:00:00Z",
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {"podCIDR": "10.244.3.0/24", "podCIDRs": ["10.244.3.0/24"], "providerID": f"baremetal://{name}"},
        "status": {
            "capacity": capacity,
            "allocatable": allocatable,
            "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": "10.0.3.17"}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": "0f4c1b2a9d8e4f6a8b7c6d5e4f3a2b1c",
                "systemUUID": "4c4c4544-0047-3010-8052-b4c04f4b4d33",
                "bootID": "7e1c9c1e-3f5d-4b8e-9e2a-6f3b2c1d0e9f",
                "kernelVersion": "5.15.0-119-generic",
                "osImage": "Ubuntu 22.04.4 LTS",
                "containerRuntimeVersion": "containerd://1.7.22",
                "kubeletVersion": "v1.33.2",
                "kubeProxyVersion": "v1.33.2",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
            "images": images,
        },
    }


def training_pod(
    job: str = "llama-lora",
    index: int = 0,
    *,
    cards: int = 8,
    workers: int = 4,
    namespace: str = "kubetune",
    resource: str = "habana.ai/gaudi",
    node_name: str | None = None,
    phase: str = "Pending",
) -> dict:
    """A PyTorchJob worker pod as the Kubeflow training operator creates it."""
    spec = {
        "volumes": [
            {
                "name": "kube-api-access-x1",
                "projected": {
                    "defaultMode": 420,
                    "sources": [{"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}],
                },
            }
        ],
        "containers": [
            {
                "name": "pytorch",
                "image": "ghcr.io/kubetune/kubetune:0.1.0",
                "command": ["kubetune", "train", "recipe.yaml"],
                "ports": [{"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"}],
                "env": [
                    {"name": "PYTHONUNBUFFERED", "value": "1"},
                    {"name": "MASTER_ADDR", "value": f"{job}-master-0"},
                    {"name": "MASTER_PORT", "value": "23456"},
                    {"name": "WORLD_SIZE", "value": str(workers)},
                    {"name": "RANK", "value": str(index)},
                    {"name": "PET_NNODES", "value": str(workers)},
                    {"name": "PET_NPROC_PER_NODE", "value": str(cards)},
                ],
                "resources": {
                    "limits": {resource: str(cards), "memory": "400Gi", "hugepages-2Mi": "9800Mi", "cpu": "80"},
                    "requests": {resource: str(cards), "memory": "400Gi", "hugepages-2Mi": "9800Mi", "cpu": "80"},
                },
                "volumeMounts": [
                    {
                        "name": "kube-api-access-x1",
                        "readOnly": True,
                        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                    }
                ],
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File",
                "imagePullPolicy": "IfNotPresent",
                "securityContext": {"capabilities": {"add": ["SYS_NICE"]}},
            }
        ],
        "restartPolicy": "OnFailure",
        "terminationGracePeriodSeconds": 30,
        "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default",
        "hostIPC": True,
        "schedulerName": "default-scheduler",
        "tolerations": [{"key": "habana.ai/gaudi", "operator": "Exists", "effect": "NoSchedule"}],
        "priority": 0,
        "enableServiceLinks": True,
        "preemptionPolicy": "PreemptLowerPriority",
    }
    if node_name:
        spec["nodeName"] = node_name
    role = "master" if index == 0 else "worker"
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": f"{job}-{role}-{max(index - 1, 0) if role == 'worker' else 0}",
            "namespace": namespace,
            "uid": f"3f2a1b0c-0000-4000-8000-{index:012d}",
            "labels": {
                "training.kubeflow.org/job-name": job,
                "training.kubeflow.org/operator-name": "pytorchjob-controller",
                "training.kubeflow.org/replica-index": str(index),
                "training.kubeflow.org/replica-type": role,
            },
            "ownerReferences": [
                {
                    "apiVersion": "kubeflow.org/v1",
                    "kind": "PyTorchJob",
                    "name": job,
                    "uid": "aa-bb",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": spec,
        "status": {"phase": phase, "qosClass": "Guaranteed"},
    }


def extender_args(pod: dict, nodes: list[dict]) -> dict:
    """ExtenderArgs as the kube-scheduler sends them with nodeCacheCapable: false."""
    return {"Pod": pod, "Nodes": {"metadata": {"resourceVersion": ""}, "items": nodes}, "NodeNames": None}
