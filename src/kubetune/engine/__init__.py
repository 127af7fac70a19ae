"""The native inference engine (torch): continuous batching over one model and many LoRA
adapters, the slot KV cache and its attention, and sampling. `kubetune serve` puts an HTTP
server around it (kubetune.serve.native builds it for that); GRPO's rollouts run it inside the
training process over the policy being trained (kubetune.training.rollout). Its requests and
events are `kubetune.contracts.engine`'s."""
