"""Cluster components: a kubelet device plugin and a kube-scheduler extender.

Layering: at module level this package imports the standard library, kubetune.errors,
kubetune.contracts (the kubeconfig loader, quantity parser, common labels, DRA names and
metric names it shares with kubetune.k8s), typer for the commands and the extender's wire
libraries (pydantic, msgspec, prometheus_client); grpc, fastapi, kubernetes and pynvml only in the modules or
functions that need them, which the commands import when they run. It never imports
torch, transformers, kubetune.training or kubetune.models, nor the job side (kubetune.k8s,
kubetune.recipe): tests/k8s/test_images_and_layers.py checks this with those made
unimportable.
"""
