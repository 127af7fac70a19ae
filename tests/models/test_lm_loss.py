"""The chunked LM-head cross-entropy equals the plain head + F.cross_entropy: loss and both
gradients, across chunk boundaries, in fp32 and under bf16 autocast."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kubetune.models.finetune import head_loss
from kubetune.models.lm_loss import (
    ACCELERATOR_CHUNK_LOGITS,
    CHUNK_ROWS,
    VOCAB_SLICE,
    head_geometry,
    sample_logprobs,
    target_cross_entropy,
)


def reference(hidden, weight, targets):
    return F.cross_entropy((hidden @ weight.t()).float(), targets, reduction="sum")


def inputs(n=37, h=24, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.3
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
@pytest.mark.parametrize("train_weight", [False, True])
@pytest.mark.parametrize("vocab_slice", [16, 101, 4096])  # 16: seven slices, the last one shorter
def test_loss_and_gradients_equal_the_plain_head(chunk, train_weight, vocab_slice):
    hidden, weight, targets = inputs()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_(train_weight)
    ours = target_cross_entropy(h1, w1, targets, chunk_rows=chunk, vocab_slice=vocab_slice)
    ref = reference(h2, w2, targets)
    (ours * 0.5).backward()  # the caller's scale reaches the stored gradients
    (ref * 0.5).backward()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    if train_weight:
        torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-5)
    else:
        assert w1.grad is None


def test_bf16_autocast_matches_the_plain_head_under_autocast():
    hidden, weight, targets = inputs(n=64, h=32, v=257)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    wb = weight.to(torch.bfloat16)  # a frozen bf16 base, as precision=bf16 loads it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = target_cross_entropy(h1, wb, targets, chunk_rows=16, vocab_slice=64)
        ref = F.cross_entropy((h2 @ wb.t()).float(), targets, reduction="sum")
    ours.backward()
    ref.backward()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=2e-3, atol=1e-2)
    assert h1.grad.dtype == torch.float32
    torch.testing.assert_close(h1.grad, h2.grad, rtol=2e-2, atol=2e-3)


def test_no_gradients_are_computed_without_grad_mode():
    hidden, weight, targets = inputs()
    with torch.no_grad():
        loss = target_cross_entropy(hidden.requires_grad_(), weight, targets, chunk_rows=5, vocab_slice=16)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference(hidden.detach(), weight, targets), rtol=1e-5, atol=1e-4)


def test_head_loss_selects_targets_and_keeps_a_head_with_bias_on_the_module_path():
    hidden, weight, targets = inputs(n=20)
    targets[::3] = -100
    plain = nn.Linear(24, 101, bias=False)
    biased = nn.Linear(24, 101, bias=True)
    with torch.no_grad():
        plain.weight.copy_(weight)
        biased.weight.copy_(weight)
        biased.bias.fill_(0.5)  # a constant shift of every logit: the loss is unchanged
    mask = targets != -100
    expected = reference(hidden[mask], weight, targets[mask])
    torch.testing.assert_close(head_loss(plain, hidden, targets), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(head_loss(biased, hidden, targets), expected, rtol=1e-5, atol=1e-4)


def test_a_target_far_below_the_row_maximum_keeps_a_finite_exact_loss():
    """The target's logit is taken before the softmax: a target 200 nats below the best
    logit (its probability underflows fp32) still gives loss = its exact gap, not inf."""
    hidden = torch.tensor([[1.0]])
    weight = torch.tensor([[100.0], [-100.0], [0.0]])  # logits 100, -100, 0
    loss = target_cross_entropy(hidden, weight, torch.tensor([1]), vocab_slice=1)
    torch.testing.assert_close(loss, torch.tensor(200.0))


def test_no_target_rows_give_a_zero_loss_and_zero_gradient():
    hidden, weight, _ = inputs(n=4)
    h = hidden.requires_grad_()
    loss = target_cross_entropy(h[:0], weight, torch.empty(0, dtype=torch.long))
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.count_nonzero(h.grad) == 0


@pytest.mark.parametrize("train_weight", [False, True])
def test_static_shapes_weigh_ignored_rows_zero_and_equal_the_selected_targets(train_weight):
    """HPU's path: every position through the head, ignored ones at weight 0, one shape for all
    batches; loss and gradients equal selecting the targets first."""
    hidden, weight, targets = inputs(n=3 * 13, seed=1)
    targets[::4] = -100
    hidden, targets = hidden.view(3, 13, -1), targets.view(3, 13)
    head_a, head_b = nn.Linear(24, 101, bias=False), nn.Linear(24, 101, bias=False)
    with torch.no_grad():
        head_a.weight.copy_(weight)
        head_b.weight.copy_(weight)
    for head in (head_a, head_b):
        head.weight.requires_grad_(train_weight)
    h_static, h_selected = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    static = head_loss(head_a, h_static, targets, static_shapes=True)
    selected = head_loss(head_b, h_selected, targets, static_shapes=False)
    static.backward()
    selected.backward()
    torch.testing.assert_close(static, selected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h_static.grad, h_selected.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(h_static.grad.view(-1, 24)[::4]) == 0  # ignored rows get no gradient
    if train_weight:
        torch.testing.assert_close(head_a.weight.grad, head_b.weight.grad, rtol=1e-5, atol=1e-5)
    biased = nn.Linear(24, 101, bias=True)  # the module path ignores them too
    with torch.no_grad():
        biased.weight.copy_(weight)
        biased.bias.zero_()
    torch.testing.assert_close(
        head_loss(biased, hidden, targets, static_shapes=True), selected.detach(), rtol=1e-5, atol=1e-4
    )


class _Ops(TorchDispatchMode):
    """Records the name of every aten operator that runs under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


# operators whose result the host must wait for on an accelerator
HOST_WAITS = {"aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select", "aten::item"}


@pytest.mark.parametrize("preference", [False, True])
def test_the_head_never_makes_the_host_wait_for_the_device(preference):
    """Forward and backward of the chunked head in several slices: no operator whose output size
    or value the host needs (on a GPU each would stall the queue of launches)."""
    hidden, weight, targets = inputs()
    hidden.requires_grad_()
    with _Ops() as ops:
        if preference:
            samples = torch.arange(len(targets)) % 5
            out = sample_logprobs(hidden, weight, targets, samples, 5, chunk_rows=8, vocab_slice=16).sum()
        else:
            out = target_cross_entropy(hidden, weight, targets, chunk_rows=8, vocab_slice=16)
        out.backward()
    assert "aten::mm" in ops.names or "aten::addmm" in ops.names  # the recorder saw the head's work
    assert not HOST_WAITS & set(ops.names), sorted(HOST_WAITS & set(ops.names))


def test_the_head_is_cache_sized_on_a_cpu_and_few_launches_elsewhere():
    assert head_geometry(torch.device("cpu"), 49152) == (CHUNK_ROWS, VOCAB_SLICE)
    rows, width = head_geometry(torch.device("cuda", 0), 49152)
    assert width == 49152 and rows * width <= ACCELERATOR_CHUNK_LOGITS and rows >= 4096  # a micro-batch in one chunk
    rows, width = head_geometry(torch.device("hpu"), 128256)  # Llama 3's vocabulary
    assert width == 128256 and rows == ACCELERATOR_CHUNK_LOGITS // 128256
    assert head_geometry(torch.device("cuda"), 10**9)[0] == CHUNK_ROWS  # a floor, however wide the head


def test_the_accelerator_geometry_equals_the_plain_head_on_any_device():
    """One slice of the whole vocabulary and one chunk (what a GPU runs), checked on the CPU."""
    hidden, weight, targets = inputs(n=300, v=257)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ours = target_cross_entropy(h1, weight, targets, chunk_rows=4096, vocab_slice=257)
    ref = reference(h2, weight, targets)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
