"""The trained weights as one whole model, and the run's sample answers from it.

How a rank gets at the whole model depends on the layout, and only here:
- whole on every rank (one process, DDP): the model itself;
- sharded (FSDP2, tensor parallel): the shards are gathered for export, and generation
  runs on every rank in lockstep (each forward's collectives need all of them);
- pipeline stages: every stage's trainable weights are gathered, and rank 0 builds the
  whole model from the files and puts them in (before training: no weights to put).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kubetune.models.decoding import generate_text
from kubetune.models.finetune import ModelParts, build_model
from kubetune.training.dist import gather_stages, gather_trainable
from kubetune.training.setup import TrainParts


@dataclass(frozen=True)
class WholeModel:
    """What rank 0 exports and generates with (None elsewhere, but under lockstep generation)."""

    parts: ModelParts | None
    # the gathered trainable weights when `parts` holds shards or another rank's stage
    # does not hold them: export writes these instead of the model's own tensors
    state: dict[str, torch.Tensor] | None = None


def whole_model(parts: TrainParts, trained: bool) -> WholeModel:
    """The model as one piece (a collective under pipeline or sharded layouts)."""
    layout, env = parts.layout, parts.env
    if layout.pp > 1:
        state = gather_stages(parts.model.loss, env) if trained else None
        if not env.is_main:
            return WholeModel(None)
        whole = build_model(parts.recipe, parts.source, env.device)
        if state is not None:
            load_trainable(whole.model, state)
        return WholeModel(whole)
    if layout.sharded and trained:
        return WholeModel(parts.model, gather_trainable(parts.model.loss))
    return WholeModel(parts.model)


def load_trainable(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put trained weights (names as the gather helpers give them) into a freshly built model."""
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise RuntimeError(f"trained weights the model does not have: {result.unexpected_keys[:3]}")


@torch.no_grad()
def sample_answers(parts: TrainParts, whole: WholeModel) -> list[dict[str, Any]]:
    """Greedy answers to the first few eval prompts, kept by rank 0.

    A whole model: only rank 0 generates. Sharded (FSDP2 or tensor parallel), every rank
    takes part in each forward's collectives: all ranks decode greedily in lockstep (the
    same tokens everywhere).
    """
    recipe, env, data = parts.recipe, parts.env, parts.data
    lockstep = parts.layout.sharded and parts.layout.pp == 1
    if whole.parts is None or (not env.is_main and not lockstep) or recipe.eval.generate == 0 or not data.eval_rows:
        return []
    lm = whole.parts.lm
    was_training = lm.training
    lm.eval()
    fsdp_root: Any = parts.model.loss if lockstep and parts.layout.fsdp > 1 else None  # an FSDPModule
    if fsdp_root is not None:
        fsdp_root.unshard()  # the root's own parameters (embeddings, head) are used outside its forward
    out = []
    for row in data.eval_rows[: recipe.eval.generate]:
        prompt = data.renderer.prompt(row)
        answer = generate_text(
            lm,
            parts.tokenizer,
            prompt,
            recipe.eval.max_new_tokens,
            add_special_tokens=not data.renderer.uses_chat_template,
            device=env.device,
            autocast=parts.autocast,
        )
        out.append(
            {
                "prompt": prompt,
                "answer": answer,
                "reference": row.get("output") or row.get("messages", [{}])[-1].get("content"),
            }
        )
    if fsdp_root is not None:
        fsdp_root.reshard()
    lm.train(was_training)
    return out if env.is_main else []
