"""kubetune on Kubernetes: render (pure) recipe -> manifests, and follow the job through one client.

Pure: `names` (object names, paths), `profiles` (cpu / gaudi / nvidia pod settings),
`objects` and `jobs` (the manifests), `render` (assembly and YAML output), `serve` (the
serving objects of a trained run: `render-serve`), `export_job` (the merged-export Job the
operator runs), `validate` (offline schema checks), `progress` and `doctor.diagnose` (reading what a job reports).
Side effects: `client` is the only module that talks to an API server; `follow` (submit,
status, logs, download, delete) and `doctor.collect` go through it; `cli` is the command
table. The kubeconfig loader, the quantity parser and the common labels come from
`kubetune.contracts.kube`, shared with `kubetune.cluster`. Nothing here imports torch,
transformers, `kubetune.training` or `kubetune.models`: tests/k8s/test_images_and_layers.py renders every
shipped recipe on every profile and api with those made unimportable.
"""
