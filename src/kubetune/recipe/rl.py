"""The `finetune.rl` recipe section: GRPO's settings (finetune.objective = grpo).

The names and defaults are TRL's `GRPOConfig` (v1.16) where TRL has the setting, so that a
TRL user's config reads the same here. kubetune's own additions are `rollout` and
`server_url` (where completions are sampled) and `log_completions`' count. What the batch
sizes mean: a row of `train.micro_batch_size` is one completion, as TRL's
`per_device_train_batch_size` counts completions; a step's completions on each process are
whole groups of `num_generations` completions of one prompt.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kubetune.recipe.base import Section

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
ScaleRewards = Literal["group", "batch", "none"]


class RewardSpec(Section):
    """One reward function with its options (a bare name or `module:function` needs none)."""

    name: str = Field(
        description="A built-in reward (accuracy, format, length, token_f1, json_schema) or a user function "
        "`module:function` with TRL's signature (prompts, completions, **columns) -> list[float | None]."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of a built-in reward (docs/rl.md lists them)."
    )


class RLSection(Section):
    """Settings of online RL (finetune.objective = grpo), by TRL's GRPOConfig names."""

    num_generations: int = Field(
        8,
        ge=2,
        description="G: completions sampled per prompt; advantages compare a completion with the others of its "
        "group, so at least 2.",
    )
    max_completion_length: int = Field(512, ge=1, description="Longest completion in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of the rollouts (1.0 = off).")
    top_k: int = Field(0, ge=0, description="Top-k sampling of the rollouts (0 = off).")
    beta: float = Field(
        0.0,
        ge=0,
        description="KL coefficient against the reference (the starting model: the adapter switched off under "
        "LoRA); 0 = no reference pass at all.",
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="Lower clipping bound of the probability ratio (1 - epsilon).")
    epsilon_high: float | None = Field(
        None, gt=0, description="Upper clipping bound (1 + epsilon_high); null = epsilon (DAPO's clip-higher: larger)."
    )
    loss_type: LossType = Field(
        "dapo",
        description="How token losses are summed: grpo (mean per completion, then over completions), bnpo (mean "
        "over the step's completion tokens), dr_grpo (sum over tokens / (completions x max_completion_length)), "
        "dapo (sum over the tokens of the whole generation batch / its token count).",
    )
    scale_rewards: ScaleRewards = Field(
        "group",
        description="Advantages divided by the std of the rewards of each group (group), of the whole step "
        "(batch), or not at all (none: Dr. GRPO).",
    )
    num_iterations: int = Field(
        1, ge=1, description="mu: optimizer passes over each generation batch (> 1 needs the old policy's log-probs)."
    )
    steps_per_generation: int | None = Field(
        None,
        ge=1,
        description="Micro-steps that one generation batch feeds; a multiple of train.grad_accum (null = "
        "train.grad_accum: one generation per optimizer step).",
    )
    mask_truncated_completions: bool = Field(
        False, description="Completions cut at max_completion_length add nothing to the loss."
    )
    reward_funcs: list[str | RewardSpec] = Field(
        default_factory=lambda: list[str | RewardSpec](["accuracy"]),
        min_length=1,
        description="Reward functions, summed with reward_weights: built-in names, `module:function` paths, or "
        "{name, options} for a built-in's options.",
    )
    reward_weights: list[float] | None = Field(None, description="One weight per reward function (null = 1.0 each).")
    log_completions: bool = Field(
        True, description="Write a sample of each logged step's completions with their rewards to completions.jsonl."
    )
    num_completions_to_print: int = Field(4, ge=1, description="Completions kept per logged step.")
    rollout: Literal["local", "server"] = Field(
        "local",
        description="local = the policy samples its own completions with kubetune's engine in the training "
        "process, on the live adapter weights; server = a `kubetune serve` at server_url samples them.",
    )
    server_url: str | None = Field(
        None,
        description="rollout=server: the base URL (http:// or https://) of a `kubetune serve` of the recipe's base "
        "model started with --allow-runtime-adapters; `kubetune k8s render` sets it to the rollout Service it adds.",
    )

    @field_validator("server_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} is not an http:// or https:// URL of a `kubetune serve`")
        return v

    @field_validator("reward_weights")
    @classmethod
    def _finite_weights(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and not v:
            raise ValueError("give one weight per reward function, or null for 1.0 each")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RLSection:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward "
                "functions; give one weight per function (or null)"
            )
        return self

    @property
    def upper_epsilon(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def reward_specs(self) -> list[RewardSpec]:
        return [RewardSpec(name=f) if isinstance(f, str) else f for f in self.reward_funcs]

    def weights(self) -> list[float]:
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.reward_funcs)

    def generation_steps(self, grad_accum: int) -> int:
        """Micro-steps one generation batch feeds (a multiple of grad_accum, checked at start)."""
        return self.steps_per_generation or grad_accum
