"""Kubelet device plugin: discovery + health (backends) and a gRPC server that only translates."""
