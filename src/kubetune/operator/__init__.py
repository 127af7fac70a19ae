"""kubetune's operator: the FineTune and ModelServer custom resources and their kopf controller
(`kubetune operator`).

`crd.py` generates the FineTune CRD from the recipe schema, `modelserver_crd.py` writes the
ModelServer's; `plan.py` is the pure decision logic (what to create, the next phase, progress
from a job) and `serverplan.py` that of shared servers (versions, the registry, what a replica
must load or unload); `handlers.py` (FineTune) and `modelserver.py` hold the thin kopf handlers,
`replicas.py` the calls to a ModelServer's replicas.
Imports recipe, contracts (kube, serving, metrics), k8s (pure renderers, client); never torch.
"""
