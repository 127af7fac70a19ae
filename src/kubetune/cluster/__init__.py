"""Cluster components: a kubelet device plugin and a kube-scheduler extender.

Layering: this package may import kubetune.errors and the standard library at module
level; grpc, fastapi, kubernetes and pynvml are imported where they are used. It never
imports kubetune.training or torch.
"""
