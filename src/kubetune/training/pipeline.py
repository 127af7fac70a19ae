"""Pipeline parallelism: consecutive decoder layers per stage, GPipe over micro-batches.

`parallel.pp = P` cuts the decoder into P stages of consecutive layers; stage 0 also owns
the token embedding, the last stage the final norm, the LM head and the loss. One
optimizer step is one GPipe schedule (torch.distributed.pipelining.ScheduleGPipe) over the
step's `train.grad_accum` micro-batches: all forwards flow down the pipeline, then all
backwards flow up, and the stages' gradients accumulate exactly as they would in one
process with the same grad_accum.

Each rank loads only its stage from the safetensors files (`models.load.load_causal_lm_stage`;
a hub id loads whole and is cut): the other layers never exist in its memory, and the ones it
keeps have their original parameter names (`...layers.7...` stays layer 7 on any stage), so DCP
checkpoints reshard between pipeline layouts, and the optimizer, clipping and export see
only this stage's weights.

The schedule needs the same tensor shapes on every step (receive buffers are sized from
the first micro-batch), so micro-batches are padded to [micro_batch_size, max_seq_len]
and steps to grad_accum micro-batches (`PipelineRunner.micro_batches`); padding is a sample of its own without targets,
so it changes no number. Packed rows keep their per-sample attention: the segments are
read back from the position ids, which restart at 0 at every sample.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn as nn

from kubetune.data.packing import IGNORE, Batch
from kubetune.models.attention import SEQLENS_KWARG
from kubetune.models.decoding import AutocastFactory
from kubetune.models.finetune import ModelParts, head_loss
from kubetune.training.dist import DistEnv
from kubetune.training.parallel import MeshLayout
from kubetune.training.runner import activation_offload


def seqlens_from_positions(position_ids: torch.Tensor) -> list[int]:
    """Segment lengths of a [B, T] batch whose positions restart at 0 for every sample."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten().tolist() + [flat.numel()]
    return [e - s for s, e in itertools.pairwise(starts)]


class StageModule(nn.Module):
    """The layers of one stage: (ids | hidden, positions) -> (hidden, positions) | normed hidden."""

    def __init__(self, decoder: nn.Module, first: bool, last: bool):
        super().__init__()
        self.decoder = decoder  # the pruned LlamaModel-like module (shared, not copied)
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
        d: Any = self.decoder
        h = d.embed_tokens(x) if self.first else x
        position_embeddings = d.rotary_emb(h, position_ids=position_ids)
        seqlens = seqlens_from_positions(position_ids)
        for layer in d.layers.values():
            h = layer(
                h,
                attention_mask=None,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                use_cache=False,
                **{SEQLENS_KWARG: seqlens},
            )
        if self.last:
            return d.norm(h)
        return h, position_ids


class PipelineRunner:
    """This rank's stage (already cut, see models.stages) and its schedule: a StepRunner."""

    def __init__(
        self,
        model: ModelParts,
        layout: MeshLayout,
        env: DistEnv,
        micro_batch_size: int,
        max_seq_len: int,
        n_micro: int,
        pad_id: int,
        autocast: AutocastFactory,
        hidden_dtype: torch.dtype,
        schedule: str = "gpipe",
        offload: bool = False,
    ):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.layout, self.device, self.offload = layout, env.device, offload
        self.mbs, self.seq, self.micro_batches, self.pad_id = micro_batch_size, max_seq_len, n_micro, pad_id
        self.autocast = autocast
        lm = model.lm
        decoder = lm.model
        stage, stages = layout.pp_rank, layout.pp
        self.first, self.last = stage == 0, stage == stages - 1
        self.lm_head = lm.lm_head
        self.module = StageModule(decoder, self.first, self.last)
        self.scale = 1.0
        self.sums: list[torch.Tensor] = []
        # Static shapes: the stage's forward reads the segments from the position values, so
        # it cannot run on the placeholder tensors that shape inference would feed it.
        ids = torch.empty(micro_batch_size, max_seq_len, dtype=torch.long, device="meta")
        # the residual stream's dtype is the embedding's (the base weights' dtype)
        hidden = torch.empty(
            micro_batch_size, max_seq_len, lm.config.hidden_size, dtype=hidden_dtype, device="meta", requires_grad=True
        )  # gradients flow back through it
        stage_module = PipelineStage(
            self.module,
            stage,
            stages,
            env.device,
            group=layout.group("pp"),
            input_args=(ids, ids) if self.first else (hidden, ids),
            output_args=hidden if self.last else (hidden, ids),
        )
        # GPipe runs every forward, then every backward: it holds all the step's micro-batches'
        # activations. 1F1B starts backwards as soon as the last stage can: at most `stages`.
        schedule_cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        self.schedule = schedule_cls(stage_module, n_microbatches=n_micro, loss_fn=self._loss, scale_grads=False)

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of the target positions (the last stage only)."""
        with self.autocast():
            loss = head_loss(self.lm_head, hidden, targets)
        self.sums.append(loss.detach())
        return loss * self.scale

    def _inputs(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Concatenate the step's micro-batches, each padded to [mbs, seq], the step to `micro_batches`."""
        ids = torch.full((self.micro_batches * self.mbs, self.seq), self.pad_id, dtype=torch.long)
        pos = torch.arange(self.seq).repeat(self.micro_batches * self.mbs, 1)
        tgt = torch.full_like(ids, IGNORE)
        for i, b in enumerate(batches):
            rows, t = b.input_ids.shape
            r0 = i * self.mbs
            ids[r0 : r0 + rows, :t] = b.input_ids
            pos[r0 : r0 + rows, :t] = b.position_ids
            pos[r0 : r0 + rows, t:] = torch.arange(self.seq - t)  # the padding tail: one segment of its own
            tgt[r0 : r0 + rows, :t] = b.targets
        return ids.to(self.device), pos.to(self.device), tgt.to(self.device)

    def _run(self, batches: list[Batch], train: bool) -> float:
        if len(batches) > self.micro_batches:
            raise ValueError(f"{len(batches)} micro-batches for a pipeline of {self.micro_batches}")
        ids, pos, tgt = self._inputs(batches)
        self.sums = []
        args = (ids, pos) if self.first else ()
        target = tgt if self.last else None  # the loss's targets live on the last stage
        with self.autocast():
            run = self.schedule.step if train else self.schedule.eval
            run(*args, target=target, return_outputs=False)
        return float(sum(s.double() for s in self.sums)) if self.last else 0.0

    def forward_backward(self, batches: list[Batch], scale: float) -> float:
        """Forward and backward of one optimizer step; returns the summed loss (last stage, else 0)."""
        self.scale = scale
        with activation_offload(self.offload, self.device):
            return self._run(batches, train=True)

    @torch.no_grad()
    def loss_sum(self, batches: list[Batch]) -> float:
        self.scale = 1.0
        return self._run(batches, train=False)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    @property
    def training(self) -> bool:
        return self.module.training
