"""The OpenAI-compatible HTTP side of `kubetune serve`, without torch: routes, request shapes,
tool calls, API keys. It reaches an engine only through `kubetune.contracts.engine`."""
