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
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_ROWS = 256  # 256 x 49,152 fp32 logits: 50 MB per chunk


def target_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int = CHUNK_ROWS,
    ignore_index: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of `hidden` [N, H] through the head `weight` [V, H] against
    `targets` [N]: every row is a target (select them before), or, with `ignore_index`, rows
    whose target is it weigh 0 (shapes that do not depend on the data). Autocast's dtype,
    when it is on, is the dtype of the head's matmuls; the softmax and the sum are fp32."""
    device_type = hidden.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss: torch.Tensor = _ChunkedHeadLoss.apply(hidden, weight, targets, compute, chunk_rows, with_grad, ignore_index)
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
    ) -> torch.Tensor:
        weight_grad = with_grad and weight.requires_grad
        w = weight.to(compute)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_rows):
                h = hidden[start : start + chunk_rows].to(compute)
                t = targets[start : start + chunk_rows]
                valid = None if ignore_index is None else t != ignore_index
                if valid is not None:
                    t = torch.where(valid, t, 0)
                logits = (h @ w.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, t[:, None]).squeeze(1)
                loss += (lse - picked).sum() if valid is None else ((lse - picked) * valid).sum()
                if not with_grad:
                    continue
                # d(sum of -log softmax[target]) / d logits = softmax - one_hot(target)
                probs = logits.sub_(lse[:, None]).exp_()
                probs[torch.arange(len(t), device=t.device), t] -= 1.0
                if valid is not None:
                    probs.mul_(valid[:, None])
                probs_c = probs.to(compute)
                assert grad_hidden is not None
                grad_hidden[start : start + chunk_rows] = probs_c @ w
                if grad_weight is not None:
                    grad_weight += (probs_c.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # the forward pass stored d(loss)/d(input); the caller's scale is all that is left
        grads = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return grads[0], grads[1], None, None, None, None, None


def sample_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    samples: torch.Tensor,
    n_samples: int,
    chunk_rows: int = CHUNK_ROWS,
    entropy: torch.Tensor | None = None,
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
    logps: torch.Tensor = _ChunkedHeadLogps.apply(
        hidden, weight, targets, samples, n_samples, compute, chunk_rows, with_grad, entropy
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
    ) -> torch.Tensor:
        w = weight.to(compute)
        valid = samples >= 0
        bins = torch.where(valid, samples, n_samples)  # the ignored rows' bin is dropped below
        out = torch.zeros(n_samples + 1, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if with_grad and hidden.requires_grad else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                h, t = hidden[rows].to(compute), targets[rows].clamp(min=0)
                logits = (h @ w.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                out.index_add_(0, bins[rows], logits.gather(1, t[:, None]).squeeze(1) - lse)
                if entropy is not None:  # H = lse - sum(p x logit)
                    h_rows = lse - (logits.softmax(-1) * logits).sum(-1)
                    entropy.index_add_(0, bins[rows].clamp(max=n_samples - 1), h_rows * valid[rows])
                if grad_hidden is None:
                    continue
                # d log softmax[target] / d logits = one_hot(target) - softmax, zero on ignored rows
                probs = logits.sub_(lse[:, None]).exp_().neg_()
                probs[torch.arange(len(t), device=t.device), t] += 1.0
                probs.mul_(valid[rows, None])
                grad_hidden[rows] = probs.to(compute) @ w
        ctx.compute, ctx.chunk_rows, ctx.n_samples = compute, chunk_rows, n_samples
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
            dw = _head_weight_grad(hidden, weight, targets, valid, per_row, ctx.compute, ctx.chunk_rows)
        return dh, dw, None, None, None, None, None, None, None


def _head_weight_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    per_row: torch.Tensor,
    compute: torch.dtype,
    chunk_rows: int,
) -> torch.Tensor:
    """sum over rows of per_row x (one_hot - softmax)^T h, the chunks' logits recomputed."""
    w = weight.to(compute)
    grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h, t = hidden[rows].to(compute), targets[rows].clamp(min=0)
            logits = (h @ w.t()).float()
            probs = logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True)).exp_().neg_()
            probs[torch.arange(len(t), device=t.device), t] += 1.0
            probs.mul_((per_row[rows] * valid[rows])[:, None])
            grad += (probs.to(compute).t() @ h).float()
    return grad.to(weight.dtype)
