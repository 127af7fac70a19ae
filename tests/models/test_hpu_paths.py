"""Gaudi's attention and batch shapes at their boundary: Habana's FusedSDPA faked by one that
runs torch's SDPA on CPU and records what it was handed."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from kubetune.data import Batcher
from kubetune.data.packing import IGNORE, shape_buckets, static_shapes
from kubetune.data.templates import PromptRenderer
from kubetune.data.tokenize import tokenize_rows
from kubetune.models import attention
from kubetune.models.attention import fused_packed_attention, per_sample_attention
from kubetune.models.finetune import TargetLoss
from kubetune.models.load import load_causal_lm

SAMPLES = Path(attention.__file__).parents[1] / "data" / "samples" / "medical_flashcards_sample.jsonl"
# two rows of 16 tokens: three samples, then two (the last 4 tokens of row 0 are padding)
LENGTHS = [5, 7, 4, 10, 6]


class FakeFusedSDPA:
    """habana_frameworks.torch.hpex.kernels.FusedSDPA: torch's SDPA, every call recorded."""

    calls: ClassVar[list[dict]] = []

    @classmethod
    def apply(cls, q, k, v, attn_mask, dropout_p, is_causal, scale, softmax_mode, recompute_mode, valid_lengths, side):
        cls.calls.append({"dtype": q.dtype, "mask": attn_mask, "is_causal": is_causal, "softmax_mode": softmax_mode})
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )


def _install_kernels(monkeypatch, kernels: types.ModuleType) -> None:
    for name, module in (
        ("habana_frameworks", types.ModuleType("habana_frameworks")),
        ("habana_frameworks.torch", types.ModuleType("habana_frameworks.torch")),
        ("habana_frameworks.torch.hpex", types.ModuleType("habana_frameworks.torch.hpex")),
        ("habana_frameworks.torch.hpex.kernels", kernels),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    attention.fused_sdpa.cache_clear()  # the kernel is looked up once per process
    attention.block_causal_mask.cache_clear()


@pytest.fixture
def fused_sdpa(monkeypatch):
    kernels = types.ModuleType("habana_frameworks.torch.hpex.kernels")
    kernels.FusedSDPA = FakeFusedSDPA
    _install_kernels(monkeypatch, kernels)
    FakeFusedSDPA.calls = []
    yield FakeFusedSDPA
    attention.fused_sdpa.cache_clear()


@pytest.fixture
def no_fused_sdpa(monkeypatch):
    _install_kernels(monkeypatch, types.ModuleType("habana_frameworks.torch.hpex.kernels"))  # older SynapseAI
    yield
    attention.fused_sdpa.cache_clear()


def _qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=g, dtype=dtype)
    k, v = (torch.randn(2, 2, 16, 8, generator=g, dtype=dtype) for _ in range(2))  # grouped-query: 2 kv heads
    return q, k, v


def _reference(q, k, v):
    return per_sample_attention(q, k, v, LENGTHS, scaling=None, dropout=0.0, upcast=False)


def test_fused_sdpa_equals_the_per_sample_reference(fused_sdpa):
    q, k, v = _qkv()
    out = fused_packed_attention(q, k, v, LENGTHS, scaling=None, dropout=0.0, kernel=attention.fused_sdpa())
    torch.testing.assert_close(out, _reference(q, k, v), atol=1e-5, rtol=1e-5)
    (call,) = fused_sdpa.calls
    assert call["is_causal"] is False and call["softmax_mode"] == "None"  # the mask carries causality
    assert call["mask"].shape == (2, 1, 16, 16)


def test_a_shared_prompt_is_masked_in_as_the_per_sample_path_reads_it(fused_sdpa):
    """GRPO's shared prompts (Batch.prefixes): segments 1 and 2 of row 0 continue segment 0."""
    q, k, v = _qkv()
    prefixes = [-1, 0, 0, -1, 3]
    out = fused_packed_attention(
        q, k, v, LENGTHS, scaling=None, dropout=0.0, prefixes=prefixes, kernel=attention.fused_sdpa()
    )
    reference = per_sample_attention(q, k, v, LENGTHS, scaling=None, dropout=0.0, upcast=False, prefixes=prefixes)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, _reference(q, k, v))  # the prefix is seen


def test_packed_documents_do_not_attend_to_each_other(fused_sdpa):
    q, k, v = _qkv()
    changed_k, changed_v = k.clone(), v.clone()
    changed_k[0, :, :5] += 3.0  # only the first document of row 0 (tokens 0-4)
    changed_v[0, :, :5] -= 2.0
    before = fused_packed_attention(q, k, v, LENGTHS, scaling=None, dropout=0.0, kernel=attention.fused_sdpa())
    after = fused_packed_attention(
        q, changed_k, changed_v, LENGTHS, scaling=None, dropout=0.0, kernel=attention.fused_sdpa()
    )
    assert not torch.allclose(before[0, :5], after[0, :5])  # the document itself sees the change
    torch.testing.assert_close(before[0, 5:], after[0, 5:], atol=0, rtol=0)  # its neighbours do not
    torch.testing.assert_close(before[1], after[1], atol=0, rtol=0)


def test_fused_sdpa_runs_in_the_training_dtype(fused_sdpa):
    q, k, v = _qkv()  # fp32, as rotary embeddings can leave them under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_packed_attention(q, k, v, LENGTHS, scaling=None, dropout=0.0, kernel=attention.fused_sdpa())
        upcast = fused_packed_attention(
            q, k, v, LENGTHS, scaling=None, dropout=0.0, upcast=True, kernel=attention.fused_sdpa()
        )
    assert [c["dtype"] for c in fused_sdpa.calls] == [torch.bfloat16, torch.float32]  # fp32 only where asked
    assert fused_sdpa.calls[0]["mask"].dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(q, k, v), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(upcast, _reference(q, k, v), atol=1e-5, rtol=1e-5)


def test_without_fused_sdpa_torch_sdpa_runs_with_one_warning(no_fused_sdpa, caplog):
    q, k, v = _qkv()
    with caplog.at_level(logging.WARNING, logger="kubetune"):
        outs = [
            fused_packed_attention(q, k, v, LENGTHS, scaling=None, dropout=0.0, kernel=attention.fused_sdpa())
            for _ in range(2)
        ]
    warnings = [r.getMessage() for r in caplog.records if "FusedSDPA" in r.getMessage()]
    assert len(warnings) == 1 and "FusedSDPA is missing" in warnings[0] and "torch SDPA" in warnings[0]
    torch.testing.assert_close(outs[1], _reference(q, k, v), atol=1e-5, rtol=1e-5)


def test_on_cuda_torch_sdpa_takes_whole_rows_and_matches_the_per_sample_gradients(caplog):
    """CUDA's path: no Habana kernel, one masked torch SDPA call; forward and gradients are
    the per-sample loop's, and nothing warns about a missing FusedSDPA."""
    attention.block_causal_mask.cache_clear()
    q, k, v = (x.requires_grad_() for x in _qkv())
    with caplog.at_level(logging.WARNING, logger="kubetune"):
        out = fused_packed_attention(q, k, v, LENGTHS, scaling=None, dropout=0.0, kernel=None)
    out.square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    reference = _reference(q, k, v)
    reference.square().sum().backward()
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not [r for r in caplog.records if "FusedSDPA" in r.getMessage()]


# --- batches of static shapes ------------------------------------------------------------


@pytest.fixture(scope="module")
def flashcards(tokenizer):
    rows = [json.loads(line) for line in SAMPLES.read_text().splitlines()[:120]]
    return tokenize_rows(rows, PromptRenderer("alpaca", tokenizer), tokenizer, 256, True)


def _epoch(data, buckets, packing=True, mbs=3):
    batcher = Batcher(data, max_seq_len=256, micro_batch_size=mbs, packing=packing, seed=1, pad_id=0, buckets=buckets)
    batches, start = [], 0
    while start < batcher.usable_rows(0):
        batch, start = batcher.micro_batch(0, start)
        batches.append(batch)
    return batches


def test_buckets_are_few_and_only_on_hpu():
    assert static_shapes("cpu", 4096) == () and static_shapes("cuda", 4096) == ()
    assert static_shapes("hpu", 4096) == (128, 256, 512, 1024, 2048, 4096)
    assert shape_buckets(3000) == (128, 256, 512, 1024, 2048, 3000)
    assert shape_buckets(64) == (64,)


@pytest.mark.parametrize("packing", [True, False])
def test_hpu_batches_take_a_few_static_shapes(flashcards, packing):
    buckets = shape_buckets(256)
    own = {tuple(b.input_ids.shape) for b in _epoch(flashcards, (), packing)}
    padded = _epoch(flashcards, buckets, packing)
    shapes = {tuple(b.input_ids.shape) for b in padded}
    assert shapes <= {(3, n) for n in buckets}
    assert len(shapes) <= len(buckets) < len(own)  # without buckets the shapes follow the data
    assert sum(b.real_tokens for b in padded) == sum(b.real_tokens for b in _epoch(flashcards, (), packing))


def test_padding_to_a_bucket_leaves_the_loss_unchanged(flashcards, tiny_model_dir, fused_sdpa, monkeypatch):
    lm = load_causal_lm(str(tiny_model_dir), torch.float32, attention.register("native")).eval()
    loss = TargetLoss(lm, lm)
    own = _epoch(flashcards, (), mbs=2)[-1]  # the epoch's last micro-batch: one short row
    padded = _epoch(flashcards, shape_buckets(256), mbs=2)[-1]
    assert padded.input_ids.shape != own.input_ids.shape and padded.target_tokens == own.target_tokens
    assert (padded.targets[:, own.input_ids.shape[1] :] == IGNORE).all()
    with torch.no_grad():
        reference = loss(own.input_ids, own.position_ids, own.targets, own.cu_seqlens)  # CPU: per sample
        monkeypatch.setattr(attention, "on_hpu", lambda x: True)
        on_gaudi = loss(padded.input_ids, padded.position_ids, padded.targets, padded.cu_seqlens)
    assert len(fused_sdpa.calls) == lm.config.num_hidden_layers  # every layer went through the kernel
    torch.testing.assert_close(on_gaudi, reference, atol=1e-4, rtol=1e-5)


def test_cuda_takes_whole_rows_until_the_mask_would_pass_a_gibibyte():
    """The dispatch's size rule, on meta tensors of a CUDA batch's shapes: 8 rows of 512 tokens
    in bf16 take one masked call; 4 rows of 32k tokens (an 8 GiB mask) keep the per-sample loop;
    a CPU batch never takes whole rows."""

    def batch(b, t, device="meta"):
        return torch.empty(b, 32, t, 64, dtype=torch.bfloat16, device=device)

    class OnCuda(torch.Tensor):  # the shape and dtype of a meta tensor, the device type of CUDA's
        @property
        def device(self):
            return torch.device("cuda", 0)

    assert attention.whole_rows_on_cuda(batch(8, 512).as_subclass(OnCuda))
    assert attention.whole_rows_on_cuda(batch(2, 16384).as_subclass(OnCuda))  # exactly 1 GiB
    assert not attention.whole_rows_on_cuda(batch(4, 32768).as_subclass(OnCuda))
    assert not attention.whole_rows_on_cuda(batch(8, 512, device="cpu"))
