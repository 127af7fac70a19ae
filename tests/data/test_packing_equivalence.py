"""Packed rows must give each sample exactly the logits it gets alone."""

import functools

import torch

from kubetune.data import Batcher
from kubetune.data.packing import Batch
from kubetune.data.sources import map_pair_columns
from kubetune.data.templates import PromptRenderer
from kubetune.data.tokenize import tokenize_pairs, tokenize_rows
from kubetune.models.attention import SEQLENS_KWARG, register, seqlens_from_cu
from kubetune.models.finetune import TargetLoss
from kubetune.models.load import load_causal_lm
from kubetune.recipe.schema import ColumnsSection


def test_packed_logits_equal_each_sample_alone(tiny_model_dir, tokenizer):
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_model_dir), torch.float32, register()).eval()
    rows = [{"instruction": "Q", "input": f"item {i} " * (1 + i), "output": "yes " * (3 + 2 * i)} for i in range(6)]
    data = tokenize_rows(rows, PromptRenderer("chat", tokenizer), tokenizer, 256, True)
    batcher = Batcher(
        data, max_seq_len=256, micro_batch_size=3, packing=True, seed=0, pad_id=tokenizer.pad_token_id, shuffle=False
    )
    rows_packed = batcher.epoch_rows(0)
    assert any(len(r) > 1 for r in rows_packed), "the test needs rows holding several samples"
    batch = batcher.collate(rows_packed[:3])
    with torch.no_grad():
        packed = model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            **{SEQLENS_KWARG: seqlens_from_cu(batch.cu_seqlens)},
        ).logits
        for r, row in enumerate(rows_packed[:3]):
            cur = 0
            for i in row:
                ids, _ = data.sample(i)
                alone = model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None]).logits[0]
                torch.testing.assert_close(packed[r, cur : cur + len(ids)], alone, atol=1e-4, rtol=1e-4)
                cur += len(ids)


def test_naive_packing_would_differ(tiny_model_dir, tokenizer):
    """Sanity check that the comparison above can fail: without segment boundaries,
    the second sample attends to the first and its logits change."""
    model = load_causal_lm(str(tiny_model_dir), torch.float32, register()).eval()
    a = tokenizer("first sample text", return_tensors="pt")["input_ids"][0]
    b = tokenizer("second one", return_tensors="pt")["input_ids"][0]
    ids = torch.cat([a, b])[None]
    with torch.no_grad():
        naive = model(input_ids=ids).logits[0, len(a) :]
        alone = model(input_ids=b[None]).logits[0]
    assert not torch.allclose(naive, alone, atol=1e-4)


def test_packed_pairs_score_each_sequence_as_it_scores_alone(tiny_model_dir, tokenizer):
    """Preference batches: the summed answer log-probability of every sequence of a packed
    pair batch, through the training forward (TargetLoss with target_sample), equals that of
    the sequence run alone; without the segment boundaries it would not."""
    model = load_causal_lm(str(tiny_model_dir), torch.float32, register()).eval()
    rows = [
        {
            "instruction": "Q",
            "input": f"item {i} " * (1 + i),
            "chosen": "yes " * (3 + 2 * i),
            "rejected": "no " * (2 + i),
        }
        for i in range(6)
    ]
    pairs = map_pair_columns(rows, ColumnsSection(), "data.train")
    data = tokenize_pairs(pairs, PromptRenderer("chat", tokenizer), tokenizer, 128, True)
    batcher = Batcher(
        data, max_seq_len=128, micro_batch_size=2, packing=True, seed=0, pad_id=tokenizer.pad_token_id, shuffle=False
    )
    batch, _ = batcher.micro_batch(0, 0)
    assert batch.pair_ids is not None and batch.chosen is not None and batch.rejected is not None
    assert any(len(r) > 2 for r in batcher.epoch_rows(0)[:2]), "the test needs rows holding several pairs"
    loss = TargetLoss(model, model)
    with torch.no_grad():
        packed = sample_logps(loss, batch, batch.cu_seqlens)
        naive = sample_logps(loss, batch, None)  # one causal segment per row: later samples see earlier ones
        for p, pair in enumerate(batch.pair_ids.tolist()):
            for s, sample in ((batch.chosen[p], 2 * pair), (batch.rejected[p], 2 * pair + 1)):
                torch.testing.assert_close(packed[s], alone_logp(model, *data.sample(sample)), atol=1e-4, rtol=1e-5)
    assert not torch.allclose(packed, naive, atol=1e-3)


def sample_logps(loss: TargetLoss, b: Batch, cu_seqlens: list[int] | None) -> torch.Tensor:
    assert b.target_sample is not None and b.pair_ids is not None
    return loss(b.input_ids, b.position_ids, b.targets, cu_seqlens, b.target_sample, 2 * len(b.pair_ids))


def alone_logp(model, ids, trainable) -> torch.Tensor:
    """The summed log-probability of a sample's trained tokens, from its own forward's logits."""
    ids_t = torch.as_tensor(ids, dtype=torch.long)
    logps = model(input_ids=ids_t[None]).logits[0, :-1].log_softmax(-1)
    picked = logps.gather(-1, ids_t[1:, None])[:, 0]
    return picked[torch.as_tensor(trainable[1:])].sum()


def test_a_flat_micro_batch_is_the_same_batch_without_padding(tiny_model_dir, tokenizer):
    """A CPU's micro-batch (`flat`): its rows end to end as one row, with no padding, and the
    same summed loss and gradients as the rows padded to the longest."""
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_model_dir), torch.float32, register())
    rows = [{"instruction": "Q", "input": f"item {i} " * (1 + i), "output": "yes " * (3 + 5 * i)} for i in range(8)]
    data = tokenize_rows(rows, PromptRenderer("chat", tokenizer), tokenizer, 96, True)
    batcher = functools.partial(
        Batcher, data, max_seq_len=96, micro_batch_size=3, packing=True, seed=0, pad_id=tokenizer.pad_token_id
    )
    padded, _ = batcher().micro_batch(0, 0)
    flat, _ = batcher(flat=True).micro_batch(0, 0)
    assert padded.input_ids.numel() > padded.real_tokens, "the test needs rows of different lengths"
    assert flat.input_ids.shape == (1, flat.real_tokens) and flat.real_tokens == padded.real_tokens
    assert flat.target_tokens == padded.target_tokens
    loss = TargetLoss(model, model)
    grads = []
    for b in (padded, flat):
        model.zero_grad()
        value = loss(b.input_ids, b.position_ids, b.targets, b.cu_seqlens)
        value.backward()
        grads.append((value.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-4, rtol=1e-5)
    for a, b in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_flat_rows_only_on_a_cpu_without_pipeline_stages():
    from kubetune.data.packing import flat_rows

    assert flat_rows("cpu", 1)
    assert not flat_rows("cpu", 2) and not flat_rows("cuda", 1) and not flat_rows("hpu", 1)


def test_a_flat_pair_micro_batch_scores_every_sequence_as_the_padded_one(tokenizer, tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir), torch.float32, register()).eval()
    rows = [
        {"instruction": "Q", "input": f"item {i} " * (1 + i), "chosen": "yes " * (3 + 2 * i), "rejected": "no"}
        for i in range(6)
    ]
    pairs = map_pair_columns(rows, ColumnsSection(), "data.train")
    data = tokenize_pairs(pairs, PromptRenderer("chat", tokenizer), tokenizer, 64, True)
    batcher = functools.partial(
        Batcher, data, max_seq_len=64, micro_batch_size=2, packing=True, seed=0, pad_id=tokenizer.pad_token_id
    )
    padded, _ = batcher().micro_batch(0, 0)
    flat, _ = batcher(flat=True).micro_batch(0, 0)
    assert padded.input_ids.shape[0] == 2 and flat.input_ids.shape == (1, flat.real_tokens)
    assert flat.pair_ids is not None and padded.pair_ids is not None
    assert flat.pair_ids.tolist() == padded.pair_ids.tolist()
    loss = TargetLoss(model, model)
    with torch.no_grad():
        torch.testing.assert_close(
            sample_logps(loss, flat, flat.cu_seqlens),
            sample_logps(loss, padded, padded.cu_seqlens),
            atol=1e-4,
            rtol=1e-5,
        )
