"""kubetune's operator: the FineTune custom resource and its kopf controller (`kubetune operator`).

`crd.py` generates the CRD from the recipe schema; `plan.py` is the pure decision logic (what to
create, the next phase, progress from a job); `handlers.py` holds the thin kopf handlers.
Imports recipe, contracts (kube, serving, metrics), k8s (pure renderers, client); never torch.
"""
