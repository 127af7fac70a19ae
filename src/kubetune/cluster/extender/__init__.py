"""kube-scheduler extender: protocol (wire types), facts (wire -> policy inputs), policy (pure), app (HTTP)."""
