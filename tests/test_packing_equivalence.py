"""Packed rows must give each sample exactly the logits it gets alone."""

import torch

from kubetune.data import Batcher
from kubetune.data.templates import PromptRenderer
from kubetune.data.tokenize import tokenize_rows
from kubetune.models.attention import SEQLENS_KWARG, register, seqlens_from_cu
from kubetune.models.load import load_causal_lm


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
