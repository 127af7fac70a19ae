"""kubetune: recipe-driven LLM fine-tuning, from one laptop process to a Kubernetes cluster."""

__version__ = "0.1.0"
