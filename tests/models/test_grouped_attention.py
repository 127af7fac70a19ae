"""The grouped attention kernel for short samples computes what flash computes, and the kernel
choice that selects it is measured, bounded and overridable."""

from __future__ import annotations

import pytest
import torch

from kubetune.models import kernels
from kubetune.models.attention import GROUPED_MAX_TOKENS, SEQLENS_KWARG, per_sample_attention, register
from kubetune.models.kernels import ModelShapes
from tests.kit.models import assert_same_step, loss_and_grads, tiny_model
from tests.models.test_kernels import FakeMachine, fake_probe, steady


def random_qkv(lengths, heads=6, kv_heads=2, dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(1, heads, t, dim, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(1, kv_heads, t, dim, generator=g).to(dtype).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(1, t, heads, dim, generator=g).to(dtype)


def attention_and_grads(q, k, v, grad_out, lengths, **kw):
    for x in (q, k, v):
        x.grad = None
    out = per_sample_attention(q, k, v, lengths, None, 0.0, **kw)
    out.backward(grad_out)
    return [out.detach(), *(x.grad.clone() for x in (q, k, v))]


@pytest.mark.parametrize("kv_heads", [1, 2, 6])
def test_grouped_kernel_equals_flash_in_output_and_gradients(kv_heads):
    lengths = [20, 1, 35, 9, 130, 600]  # 130: three blocks; 600: longer than the kernel takes
    q, k, v, grad_out = random_qkv(lengths, kv_heads=kv_heads)
    flash = attention_and_grads(q, k, v, grad_out, lengths, upcast=True)
    grouped = attention_and_grads(q, k, v, grad_out, lengths, upcast=True, grouped_up_to=GROUPED_MAX_TOKENS)
    for a, b in zip(flash, grouped, strict=True):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)


def test_grouped_kernel_keeps_samples_apart_and_causal():
    """Changing later tokens of a sample (inside its second block of queries), or any token of
    another sample, must not move an earlier output; the test can fail: the same change does
    move the later outputs."""
    lengths = [100, 90]
    q, k, v, _ = random_qkv(lengths)
    before = per_sample_attention(q, k, v, lengths, None, 0.0, upcast=True, grouped_up_to=512)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, 70:100] += 5.0  # the first sample's last tokens
    v2[:, :, 70:100] -= 3.0
    k2[:, :, 100:] = 0.0  # the whole second sample's keys
    after = per_sample_attention(q, k2, v2, lengths, None, 0.0, upcast=True, grouped_up_to=512)
    torch.testing.assert_close(after[:, :70], before[:, :70])
    assert not torch.allclose(after[:, 70:100], before[:, 70:100])
    assert not torch.allclose(after[:, 100:], before[:, 100:])


def test_grouped_kernel_in_bf16_stays_near_fp32():
    lengths = [40, 24]
    q, k, v, _ = random_qkv(lengths, dtype=torch.bfloat16)
    ref = per_sample_attention(q, k, v, lengths, None, 0.0, upcast=True)
    half = per_sample_attention(q, k, v, lengths, None, 0.0, upcast=False, grouped_up_to=64)
    assert half.dtype == torch.bfloat16 and torch.allclose(half.float(), ref.float(), atol=3e-2)


def test_segments_with_a_prefix_keep_flash():
    lengths = [10, 6, 6]
    q, k, v, _ = random_qkv(lengths)
    prefixes = [-1, 0, 0]  # GRPO: two completions continue the prompt segment
    flash = per_sample_attention(q, k, v, lengths, None, 0.0, True, prefixes)
    grouped = per_sample_attention(q, k, v, lengths, None, 0.0, True, prefixes, grouped_up_to=64)
    torch.testing.assert_close(grouped, flash, atol=2e-6, rtol=1e-5)


def test_a_tiny_llama_trains_the_same_with_either_kernel(tokenizer):
    """The registered implementation reaches the model: loss and every gradient agree."""
    ids = torch.randint(0, len(tokenizer), (1, 60), generator=torch.Generator().manual_seed(1))
    lengths, positions = [25, 5, 30], torch.cat([torch.arange(n) for n in (25, 5, 30)])[None]
    results = []
    for grouped_up_to in (0, 64):
        model = tiny_model(tokenizer, seed=3)
        model.set_attn_implementation(register("fp32", grouped_up_to))
        results.append(
            loss_and_grads(model, input_ids=ids, position_ids=positions, labels=ids, **{SEQLENS_KWARG: lengths})
        )
    assert_same_step(*results)


SHORT = ModelShapes(hidden=64, intermediate=128, heads=6, head_dim=16, sample_lengths=(20, 35, 600, 9), kv_heads=2)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBETUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


@pytest.mark.parametrize(
    ("grouped_ms", "expected"),
    [(4.0, GROUPED_MAX_TOKENS), (5.0, 0), (4.9, 0)],  # faster; slower; faster by less than the margin
    ids=["grouped-faster", "flash-faster", "within-margin"],
)
def test_the_grouped_kernel_is_chosen_only_where_it_measures_faster(cache, monkeypatch, grouped_ms, expected):
    m = FakeMachine(fp32=steady(6.0), bf16=steady(60.0), flash=steady(5.0), grouped=steady(grouped_ms))
    fake_probe(monkeypatch, m, flags_have_bf16=False)
    plan = kernels.choose("auto", "auto", SHORT, torch.device("cpu"), clock=m.clock)
    assert plan.grouped_up_to == expected
    assert (f"grouped attention up to {GROUPED_MAX_TOKENS} tokens" in plan.describe()) == bool(expected)
    line = plan.describe()
    assert "grouped_attention: " in line and "flash 5.0 ms" in line and f"grouped {grouped_ms} ms" in line


def test_no_grouped_question_where_the_recipe_sets_attention_or_no_sample_is_short(cache, monkeypatch):
    m = FakeMachine(fp32=steady(6.0), bf16=steady(60.0), flash=steady(5.0), grouped=steady(1.0))
    fake_probe(monkeypatch, m, flags_have_bf16=False)
    assert kernels.choose("auto", "fp32", SHORT, torch.device("cpu"), clock=m.clock).grouped_up_to == 0
    long_only = ModelShapes(64, 128, 6, 16, (GROUPED_MAX_TOKENS + 1, GROUPED_MAX_TOKENS + 40), 2)
    assert kernels.choose("auto", "auto", long_only, torch.device("cpu"), clock=m.clock).grouped_up_to == 0
    assert m.calls["grouped"] == 0 and not list(cache.glob("grouped_attention-*.json"))


def test_the_real_probe_times_both_kernels_on_the_rows_short_samples(cache):
    plan = kernels.choose("fp32", "auto", SHORT, torch.device("cpu"))
    (line,) = [e for e in plan.evidence if e.startswith("grouped_attention:")]
    assert "flash" in line and "grouped" in line and "per layer" in line
    assert plan.grouped_up_to in (0, GROUPED_MAX_TOKENS)
