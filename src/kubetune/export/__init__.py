"""A run's weights out of training: saved and loaded back (`weights`), merged into an HF
directory (`merged`), one GGUF file (`gguf`). The Kubernetes Job that runs the merged export on
the run's volume is `kubetune.k8s.export_job`.
"""
