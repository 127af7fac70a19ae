"""The LM head and its cross-entropy in one pass over row chunks, never the whole logits.

`F.cross_entropy(lm_head(hidden))` keeps the [targets x vocab] logits, their fp32 copy and
the log-softmax for the backward pass: for SmolLM2's 49k vocabulary and the ~1,100 target
tokens of one default micro-batch that is ~650 MB of a step's peak, and under bf16 a full
cast of the logits. Here the head runs on chunks of rows: each chunk's logits are computed
in the compute dtype (bf16 under autocast), their log-sum-exp in fp32, and, because the loss
is the end of the graph, the chunk's gradient with respect to the hidden states (and to the
head's weight when it trains) is computed right there and the logits are dropped. The
backward pass only scales what the forward pass stored. The FLOPs are the same as the plain
path's; the memory is one chunk's logits. (Liger-Kernel's fused linear cross-entropy does
the same on GPUs.) `sample_logprobs` is the same pass for the preference objectives: each
sample's summed target log-probability instead of one summed loss.

Within a chunk, the vocabulary is taken in slices (`_SlicedSoftmax`): each slice's logits are
computed, reduced to their maximum and exponentiated while they are in cache, and the row's
softmax is put together from the slices' maxima and sums, as flash attention puts together
its rows. The gradient pass then scales each slice and multiplies it back into the hidden
states' gradient, again a slice at a time. Against the whole chunk at once this writes the
logits once instead of three times and never allocates a temporary of the chunk's size.

Those sizes are a CPU's (`head_geometry`). On an accelerator every operation of every slice
is a kernel launch, and a micro-batch of CPU-sized pieces is thousands of them: the host, not
the GPU, set the pace of a step there (BENCHMARKS.md, "A ~1B Llama on an NVIDIA H200"). There
a chunk holds up to 2^28 logits and a slice is the whole vocabulary, so that a micro-batch is
a handful of launches; the memory is still one chunk's logits. Nothing here waits for the
device: a slice picks its targets' logits and subtracts their one-hot by gather and scatter
under a mask, not by looking up which rows it holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

CHUNK_ROWS = 256  # 256 x 49,152 fp32 logits: 50 MB per chunk
# Columns of one chunk's logits that are computed, normalised and multiplied back while they are
# still in cache: the head's matmul writes less at a time, and the softmax passes read and write
# a slice instead of the whole chunk (bench/experiments/head_loss_parts.py times the choice).
VOCAB_SLICE = 2048
ACCELERATOR_CHUNK_LOGITS = 2**28  # fp32 logits of one chunk off the CPU: 1 GiB


def head_geometry(device: torch.device, vocab: int) -> tuple[int, int]:
    """(rows per chunk, vocabulary slice) of the chunked head on `device` (module docstring):
    cache-sized on a CPU; on an accelerator few launches, the whole vocabulary per slice."""
    if device.type == "cpu":
        return CHUNK_ROWS, VOCAB_SLICE
    return max(CHUNK_ROWS, ACCELERATOR_CHUNK_LOGITS // max(vocab, 1)), max(vocab, 1)


class _SlicedSoftmax:
    """The softmax of one chunk of rows over the vocabulary, slice by slice, and the targets'
    logits. `exps[s]` holds exp(logit - slice max) of slice s; a row's probabilities in slice s
    are that times `scale[s]` (the slice max's offset from the row max, over the row's sum)."""

    def __init__(
        self, h: torch.Tensor, parts: tuple[torch.Tensor, ...], targets: torch.Tensor, entropy: bool = False
    ) -> None:
        width = parts[0].shape[0]
        self.parts, self.slice_of, column = parts, targets // width, targets % width
        # each slice's target column per row (clamped into a shorter last slice; masked out there)
        self.columns = [column.clamp(max=len(part) - 1)[:, None] for part in parts]
        self.picked = torch.zeros(len(h), dtype=torch.float32, device=h.device)
        self.exps: list[torch.Tensor] = []
        maxes, sums, plogp = [], [], []
        for s, part in enumerate(parts):
            logits = (h @ part.t()).float()
            self.picked = torch.where(self.holds(s), logits.gather(1, self.columns[s]).squeeze(1), self.picked)
            top = logits.amax(dim=-1)
            exp = logits.sub_(top[:, None]).exp_()
            maxes.append(top)
            sums.append(exp.sum(dim=-1))
            if entropy:  # sum of e log e, e = exp(logit - slice max): what H needs of this slice
                plogp.append(torch.xlogy(exp, exp).sum(dim=-1))
            self.exps.append(exp)
        top_all = torch.stack(maxes)  # [slices, rows]
        self.top = top_all.amax(dim=0)
        rescale = (top_all - self.top).exp_()
        self.total = (torch.stack(sums) * rescale).sum(dim=0)
        self.scale = rescale / self.total
        self.lse = self.top + self.total.log()
        if entropy:  # H = lse - sum(p x logit), logit = log e + slice max
            inner = (torch.stack(plogp) + torch.stack(sums) * top_all) * self.scale
            self.entropy = self.lse - inner.sum(dim=0)

    def holds(self, s: int) -> torch.Tensor:
        """[rows] bool: the rows whose target lies in slice s."""
        return self.slice_of == s

    def grad_slices(
        self, compute: torch.dtype, row_scale: torch.Tensor | None = None
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Each slice's first vocabulary id, weight part and (softmax - one_hot(target)) x
        `row_scale` per row, in `compute`. Consumes `exps` (the gradient is made in place)."""
        start = 0
        for s, part in enumerate(self.parts):
            coef = self.scale[s] if row_scale is None else self.scale[s] * row_scale
            grad = self.exps[s].mul_(coef[:, None])
            one_hot = self.holds(s).to(grad.dtype) if row_scale is None else self.holds(s) * row_scale
            # adds a zero where the target lies in another slice: those entries keep their values
            grad.scatter_add_(1, self.columns[s], one_hot.neg_()[:, None])
            yield start, part, grad.to(compute)
            start += len(part)

    def grad_hidden(
        self,
        h: torch.Tensor,
        compute: torch.dtype,
        row_scale: torch.Tensor | None = None,
        grad_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """d(sum over rows of -log softmax[target] x row_scale) / d h; adds the head weight's
        gradient to `grad_weight` when given."""
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        for start, part, g in self.grad_slices(compute, row_scale):
            if g.dtype == out.dtype:
                out.addmm_(g, part)
            else:  # half-precision products summed in fp32, so that the slices do not round each other
                out += (g @ part).float()
            if grad_weight is not None:
                grad_weight[start : start + len(part)] += (g.t() @ h).float()
        return out


def _geometry(
    hidden: torch.Tensor, weight: torch.Tensor, chunk_rows: int | None, vocab_slice: int | None
) -> tuple[int, int]:
    """The caller's chunk rows and vocabulary slice, `head_geometry`'s where it gave none."""
    rows, width = head_geometry(hidden.device, weight.shape[0])
    return chunk_rows or rows, vocab_slice or width


def target_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int | None = None,
    ignore_index: int | None = None,
    vocab_slice: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of `hidden` [N, H] through the head `weight` [V, H] against
    `targets` [N]: every row is a target (select them before), or, with `ignore_index`, rows
    whose target is it weigh 0 (shapes that do not depend on the data). Autocast's dtype,
    when it is on, is the dtype of the head's matmuls; the softmax and the sum are fp32."""
    device_type = hidden.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    chunk_rows, vocab_slice = _geometry(hidden, weight, chunk_rows, vocab_slice)
    loss: torch.Tensor = _ChunkedHeadLoss.apply(
        hidden, weight, targets, compute, chunk_rows, with_grad, ignore_index, vocab_slice
    )
    return loss


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        compute: torch.dtype,
        chunk_rows: int,
        with_grad: bool,
        ignore_index: int | None,
        vocab_slice: int,
    ) -> torch.Tensor:
        weight_grad = with_grad and weight.requires_grad
        w = weight.to(compute)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None
        with torch.autocast(hidden.device.type, enabled=False):
            parts = w.split(vocab_slice)
            for start in range(0, hidden.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                h, t = hidden[rows].to(compute), targets[rows]
                valid = None if ignore_index is None else (t != ignore_index).float()
                if valid is not None:
                    t = torch.where(valid > 0, t, 0)
                soft = _SlicedSoftmax(h, parts, t)
                per_row = soft.lse - soft.picked
                loss += per_row.sum() if valid is None else (per_row * valid).sum()
                if with_grad:
                    assert grad_hidden is not None
                    grad_hidden[rows] = soft.grad_hidden(h, compute, valid, grad_weight)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # the forward pass stored d(loss)/d(input); the caller's scale is all that is left
        grads = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return grads[0], grads[1], None, None, None, None, None, None


def sample_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    samples: torch.Tensor,
    n_samples: int,
    chunk_rows: int | None = None,
    entropy: torch.Tensor | None = None,
    vocab_slice: int | None = None,
) -> torch.Tensor:
    """Summed target log-probabilities per sample [n_samples] (fp32) of `hidden` [N, H]
    through the head `weight` [V, H]: row i adds log p(targets[i]) to sample `samples[i]`;
    a row whose sample is -1 (padding, prompts under static shapes) adds nothing. With each
    row its own sample, these are per-token log-probabilities (GRPO's). `entropy` ([n_samples]
    fp32, optional) receives each sample's summed entropy of the predicted distribution, a
    metric (no gradient), from the same chunks' logits.

    The same chunked head as `target_cross_entropy`, for the preference objectives, whose
    loss is a function of each sequence's log-probability: the gradient of a row is its
    sample's upstream gradient times (one_hot - softmax), so the forward pass stores the
    unscaled gradient of the hidden states, and the backward pass scales it row by row. A
    trained head's weight gradient needs those scales inside the sum over rows: the backward
    pass recomputes the chunks' logits for it (full fine-tuning only; LoRA's head is frozen).
    """
    device_type = hidden.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    chunk_rows, vocab_slice = _geometry(hidden, weight, chunk_rows, vocab_slice)
    logps: torch.Tensor = _ChunkedHeadLogps.apply(
        hidden, weight, targets, samples, n_samples, compute, chunk_rows, with_grad, entropy, vocab_slice
    )
    return logps


class _ChunkedHeadLogps(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        samples: torch.Tensor,
        n_samples: int,
        compute: torch.dtype,
        chunk_rows: int,
        with_grad: bool,
        entropy: torch.Tensor | None,
        vocab_slice: int,
    ) -> torch.Tensor:
        w = weight.to(compute)
        valid = samples >= 0
        bins = torch.where(valid, samples, n_samples)  # the ignored rows' bin is dropped below
        out = torch.zeros(n_samples + 1, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if with_grad and hidden.requires_grad else None
        with torch.autocast(hidden.device.type, enabled=False):
            parts = w.split(vocab_slice)
            for start in range(0, hidden.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                h, t = hidden[rows].to(compute), targets[rows].clamp(min=0)
                soft = _SlicedSoftmax(h, parts, t, entropy=entropy is not None)
                out.index_add_(0, bins[rows], soft.picked - soft.lse)
                if entropy is not None:
                    entropy.index_add_(0, bins[rows].clamp(max=n_samples - 1), soft.entropy * valid[rows])
                if grad_hidden is not None:  # d log softmax[target] / d logits = -(softmax - one_hot)
                    grad_hidden[rows] = soft.grad_hidden(h, compute, -valid[rows].float())
        ctx.compute, ctx.chunk_rows, ctx.vocab_slice = compute, chunk_rows, vocab_slice
        ctx.weight_grad = with_grad and weight.requires_grad
        ctx.save_for_backward(grad_hidden, hidden if ctx.weight_grad else None, weight, targets, bins, valid)
        return out[:n_samples]

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, hidden, weight, targets, bins, valid = ctx.saved_tensors
        # each row's upstream gradient is its sample's; the dropped bin's is 0
        per_row = torch.cat([grad_out.float(), grad_out.new_zeros(1, dtype=torch.float32)])[bins]
        dh = None if grad_hidden is None else grad_hidden * per_row[:, None].to(grad_hidden.dtype)
        dw = None
        if ctx.weight_grad:
            dw = _head_weight_grad(
                hidden, weight, targets, -(per_row * valid), ctx.compute, ctx.chunk_rows, ctx.vocab_slice
            )
        return dh, dw, None, None, None, None, None, None, None, None


def _head_weight_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_scale: torch.Tensor,
    compute: torch.dtype,
    chunk_rows: int,
    vocab_slice: int,
) -> torch.Tensor:
    """sum over rows of row_scale x (softmax - one_hot)^T h, the chunks' logits recomputed."""
    w = weight.to(compute)
    grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    with torch.autocast(hidden.device.type, enabled=False):
        parts = w.split(vocab_slice)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h, t = hidden[rows].to(compute), targets[rows].clamp(min=0)
            for first, part, g in _SlicedSoftmax(h, parts, t).grad_slices(compute, row_scale[rows]):
                grad[first : first + len(part)] += (g.t() @ h).float()
    return grad.to(weight.dtype)
