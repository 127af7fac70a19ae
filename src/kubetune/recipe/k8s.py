"""The `k8s` recipe section: how the same recipe runs as a Kubeflow job.

Only read by `kubetune k8s ...`; local training ignores it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class K8sSection(_Strict):
    """Cluster job settings (see README, "Cluster guide")."""

    namespace: str = Field("kubetune", description="Namespace of every rendered object.")
    name: str | None = Field(None, description="Job name; defaults to a name derived from output_dir.")
    image: str = Field("ghcr.io/kubetune/kubetune:0.1.0", description="Container image that has kubetune installed.")
    replicas: int = Field(2, ge=1, description="Number of worker pods (nodes).")
