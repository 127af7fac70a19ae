"""kubetune on Kubernetes: render (pure) recipe -> manifests, and follow the job through one client.

Pure: `names` (object names, paths), `profiles` (cpu / gaudi / nvidia pod settings),
`objects` and `jobs` (the manifests), `render` (assembly and YAML output), `validate`
(offline schema checks), `progress` and `doctor.diagnose` (reading what a job reports).
Side effects: `client` is the only module that talks to an API server; `follow` (submit,
status, logs, download, delete) and `doctor.collect` go through it; `cli` is the command
table. Nothing here imports torch or `kubetune.training`.
"""
