"""The test kit: the helpers more than one test folder uses (one definition each).

- `models`: the tiny Llama builders (the suite's shared one and the variants built from it).
- `cli`: `kubetune ARGS` run in a subprocess or in this process.
- `kube`: kmock's Kubernetes API served over loopback HTTP on its own thread.
- `processes`: stopping a training run after its first checkpoint.
- `skips`: the skips the suite expects; any other one fails the run.
"""
