"""kubetune on Kubernetes: render (pure) recipe -> manifests, and follow the job through one client.

Layers: `render`, `profiles`, `validate`, `progress` and `doctor`'s analysis are pure;
`client` is the only module that talks to an API server; `follow` (submit, status, logs,
download, delete) and `doctor.collect` use it; `cli` is the command table. Nothing here
imports torch or `kubetune.training`.
"""
