"""The native serving engine (torch): the served models and adapters, the KV cache, continuous
batching and sampling. The HTTP side talks to it through `kubetune.serve.engine_client`."""
