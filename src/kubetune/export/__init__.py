"""A run's weights out of training: saved and loaded back (`weights`), merged into an HF
directory (`merged`), one GGUF file (`gguf`), and the Kubernetes Job that runs the merged
export on the run's volume (`job`).

Nothing is imported here: `job` renders without torch (the operator imports it), the others
load models.
"""
