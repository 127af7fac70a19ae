"""Pipeline stages of a decoder: which layers a stage owns, and cutting a model down to one.

This is the only place a model is cut: `models.load.load_causal_lm_stage` builds a stage
(from the files when it can, else by loading whole and cutting), and the training pipeline
runs whatever stage it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.nn as nn


@dataclass(frozen=True)
class Stage:
    index: int  # 0-based
    count: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """Consecutive, as-even-as-possible layer ranges, earlier stages taking the remainder."""
    return [range(int(c[0]), int(c[-1]) + 1) for c in np.array_split(np.arange(num_layers), stages)]


def keep_stage(lm: Any, stage: Stage) -> None:
    """Cut a *ForCausalLM down to one stage, in place: its layers (under their original
    indices, so parameter names stay those of the whole model), the embedding on the first
    stage, the norm and head on the last."""
    decoder: Any = lm.model
    owned = stage_layers(len(decoder.layers), stage.count)[stage.index]
    decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in owned})
    if not stage.first:
        decoder.embed_tokens = nn.Identity()  # no weights; PEFT asks every model for its input embeddings
    if not stage.last:
        decoder.norm = None
        lm.lm_head = None


def decoder_layers(lm: Any) -> list[Any]:
    """The decoder layers a (possibly cut) *ForCausalLM holds, in order."""
    layers: Any = lm.model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
