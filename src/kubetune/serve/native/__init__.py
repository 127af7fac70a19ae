"""The native engine's serving side (torch): the served models and adapters, grammars for
structured output, oneDNN-packed layers, the container's limits, vLLM's metrics, and the
builder that puts them around `kubetune.engine.core.Engine`. The HTTP side talks to it through
`kubetune.contracts.engine`."""
