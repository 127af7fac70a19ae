"""kube-scheduler extender: protocol (wire types), facts (wire -> policy inputs), policy (pure), app (HTTP)."""

DEFAULT_PORT = 8888  # where the extender listens: its --port, the manifests' Service and the scheduler's urlPrefix
