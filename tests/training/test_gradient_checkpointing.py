"""`train.gradient_checkpointing=on_offload` (seed 000's `checkpoint_wrapper(offload_to_cpu=True)`):
each decoder layer is recomputed in backward AND the tensors it saves wait in CPU memory, with
the same gradients as no checkpointing. Measured on the tiny Llama through kubetune's own
model preparation and `LocalRunner`: recomputation by counting a layer's forward calls, the
offload by what torch's `save_on_cpu` hooks pack."""

from __future__ import annotations

import contextlib
from typing import ClassVar

import pytest
import torch

from kubetune.data.packing import IGNORE, Batch
from kubetune.models.finetune import build_model
from kubetune.recipe import load_recipe
from kubetune.recipe.schema import OFFLOADS
from kubetune.training import runner as runner_module
from kubetune.training.runner import LocalRunner

ROWS, SEQ = 2, 24


class RecordingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's save_on_cpu, doing its real work, that also records what it packed."""

    instances: ClassVar[list[RecordingSaveOnCpu]] = []

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        super().__init__(pin_memory=pin_memory, device_type=device_type)
        self.packed: list[tuple[tuple[int, ...], torch.device]] = []
        real_pack = self.pack_hook

        def pack(tensor: torch.Tensor) -> object:
            packed = real_pack(tensor)
            self.packed.append((tuple(tensor.shape), packed[1].device))  # (original device, cpu copy)
            return packed

        self.pack_hook = pack
        RecordingSaveOnCpu.instances.append(self)


def _batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (ROWS, SEQ), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = IGNORE
    return Batch(
        input_ids=ids,
        position_ids=torch.arange(SEQ).repeat(ROWS, 1),
        targets=targets,
        cu_seqlens=[i * SEQ for i in range(ROWS + 1)],
        real_tokens=ROWS * SEQ,
        target_tokens=ROWS * (SEQ - 1),
    )


def _gradients(tiny_model_dir, mode: str) -> tuple[dict[str, torch.Tensor], int]:
    """LoRA gradients of one forward/backward, and how often layer 0's MLP ran."""
    recipe = load_recipe(
        None, [f"model.name_or_path={tiny_model_dir}", "train.precision=fp32", f"train.gradient_checkpointing={mode}"]
    ).recipe.with_kernels("fp32", "fp32")
    torch.manual_seed(0)
    parts = build_model(recipe, str(tiny_model_dir), torch.device("cpu"))
    parts.model.train()
    mlp = parts.lm.model.layers[0].mlp
    calls, forward = [], mlp.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    mlp.forward = counted  # an instance attribute: module hooks do not run on checkpoint's recompute
    runner = LocalRunner(parts.loss, parts.loss, torch.device("cpu"), contextlib.nullcontext, offload=mode in OFFLOADS)
    runner.forward_backward([_batch(parts.lm.config.vocab_size)], scale=1.0)
    grads = {n: p.grad.clone() for n, p in parts.model.named_parameters() if p.requires_grad}
    return grads, len(calls)


@pytest.fixture
def recorded(monkeypatch):
    RecordingSaveOnCpu.instances = []
    monkeypatch.setattr(runner_module.torch.autograd.graph, "save_on_cpu", RecordingSaveOnCpu)
    return RecordingSaveOnCpu.instances


def test_on_offload_recomputes_offloads_and_keeps_the_gradients(tiny_model_dir, recorded):
    reference, forwards_off = _gradients(tiny_model_dir, "off")
    assert not recorded and forwards_off == 1
    grads, forwards = _gradients(tiny_model_dir, "on_offload")
    assert forwards == 2, "on_offload must recompute each layer in backward"
    assert len(recorded) == 1
    hidden = parts_hidden(tiny_model_dir)
    boundary = [device for shape, device in recorded[0].packed if shape == (ROWS, SEQ, hidden)]
    # what the two checkpointed layers save is their input (plus the final norm's, outside them)
    assert len(boundary) >= 2 and all(d.type == "cpu" for d in boundary)
    assert grads.keys() == reference.keys() and any(g.abs().sum() > 0 for g in reference.values())
    for name, g in reference.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_offload_alone_does_not_recompute_and_saves_more(tiny_model_dir, recorded):
    _, forwards_on = _gradients(tiny_model_dir, "on")
    assert forwards_on == 2 and not recorded
    _, forwards = _gradients(tiny_model_dir, "offload")
    assert forwards == 1
    _gradients(tiny_model_dir, "on_offload")
    offload_only, both = recorded
    # without recomputation every intermediate tensor of every layer is saved (and moved)
    assert len(offload_only.packed) > 2 * len(both.packed)


def parts_hidden(tiny_model_dir) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(tiny_model_dir).hidden_size)
