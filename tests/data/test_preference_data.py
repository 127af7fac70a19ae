"""Preference data (finetune.objective != sft): rows of a prompt and two answers, tokenized as
SFT rows, batched by whole pairs."""

import json

import numpy as np
import pytest
import torch

from kubetune.data import Batcher, prepare_data
from kubetune.data.packing import IGNORE, pair_shapes, shape_buckets
from kubetune.data.sources import map_pair_columns
from kubetune.data.templates import PromptRenderer
from kubetune.data.tokenize import cache_key, tokenize_pairs, tokenize_rows
from kubetune.errors import DataError
from kubetune.recipe import load_recipe
from kubetune.recipe.schema import ColumnsSection

QUESTION = "What does insulin do?"
CHOSEN = "Insulin lowers blood glucose."
REJECTED = "Insulin raises blood pressure."


def pairs_of(n: int) -> list[dict]:
    """kubetune's own pair rows (what `kubetune data make-preferences` writes), of growing lengths."""
    return [
        {
            "instruction": "Answer this question truthfully",
            "input": f"What is fact number {i}?",
            "chosen": f"Fact {i} is that {i} plus {i} equals {2 * i}." + " Indeed." * (i % 4),
            "rejected": f"Fact {i} is unknown." + " Sorry." * (i % 3),
        }
        for i in range(n)
    ]


def tokenized(rows: list[dict], tokenizer, columns=None, template="chat", max_seq_len=256, truncate=True):
    mapped = map_pair_columns(rows, columns or ColumnsSection(), "data.train")
    return tokenize_pairs(mapped, PromptRenderer(template, tokenizer), tokenizer, max_seq_len, truncate)


def same(a, b) -> bool:
    return (
        np.array_equal(a.ids, b.ids)
        and np.array_equal(a.trainable, b.trainable)
        and np.array_equal(a.offsets, b.offsets)
    )


@pytest.mark.parametrize("template", ["chat", "alpaca"])
def test_the_three_layouts_tokenize_as_the_sft_rows_of_each_answer(tokenizer, template):
    ours = tokenized(
        [{"instruction": QUESTION, "input": "", "chosen": CHOSEN, "rejected": REJECTED}], tokenizer, template=template
    )
    trl = tokenized(
        [{"prompt": QUESTION, "chosen": CHOSEN, "rejected": REJECTED}],
        tokenizer,
        ColumnsSection(instruction="prompt"),
        template,
    )
    sft = tokenize_rows(
        [{"instruction": QUESTION, "input": "", "output": answer} for answer in (CHOSEN, REJECTED)],
        PromptRenderer(template, tokenizer),
        tokenizer,
        256,
        True,
    )
    assert ours.pairs and len(ours) == 1 and ours.samples == 2 and not sft.pairs
    assert same(ours, sft) and same(trl, sft)
    if template == "chat":  # a conversation's user turn is the chat template's rendering of the question
        prompt = [{"role": "user", "content": QUESTION}]
        chat = tokenized(
            [{"prompt": prompt, "chosen": CHOSEN, "rejected": REJECTED}], tokenizer, ColumnsSection(messages="prompt")
        )
        trl_chat = tokenized(
            [
                {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": CHOSEN}],
                    "rejected": [{"role": "assistant", "content": REJECTED}],
                }
            ],
            tokenizer,
            ColumnsSection(messages="prompt"),
        )
        assert same(chat, sft) and same(trl_chat, sft)


def test_labels_only_on_the_answers_and_one_eos(tokenizer):
    rows = [{"instruction": QUESTION, "input": "", "chosen": CHOSEN + tokenizer.eos_token, "rejected": REJECTED}]
    data = tokenized(rows, tokenizer)
    renderer = PromptRenderer("chat", tokenizer)
    prompt_ids = tokenizer(renderer.prompt(rows[0]), add_special_tokens=False)["input_ids"]
    for sample, answer in enumerate((CHOSEN, REJECTED)):
        ids, trainable = data.sample(sample)
        assert list(ids[: len(prompt_ids)]) == prompt_ids and not trainable[: len(prompt_ids)].any()
        assert trainable[len(prompt_ids) :].all()
        response = ids[len(prompt_ids) :]
        assert response[-1] == tokenizer.eos_token_id and (response == tokenizer.eos_token_id).sum() == 1
        assert tokenizer.decode(response[:-1]) == answer


def test_each_answer_is_truncated_as_sft_truncates_and_a_long_prompt_refused(tokenizer):
    rows = [{"instruction": QUESTION, "input": "", "chosen": "yes " * 300, "rejected": "no"}]
    data = tokenized(rows, tokenizer, max_seq_len=64)
    assert data.lengths[0] == 64 and data.lengths[1] < 64
    assert data.sample(0)[0][-1] == tokenizer.eos_token_id
    with pytest.raises(DataError, match=r"row 0 of data.train \(chosen answer\) has \d+ tokens; .*data.truncate=true"):
        tokenized(rows, tokenizer, max_seq_len=64, truncate=False)
    with pytest.raises(DataError, match=r"shorter than the prompt of row 0 of data\.train"):
        tokenized([{**rows[0], "instruction": "why " * 100}], tokenizer, max_seq_len=64)


def every_batch(batcher: Batcher, epoch: int = 0):
    row = 0
    while row < batcher.usable_rows(epoch):
        batch, row = batcher.micro_batch(epoch, row)
        yield batch


@pytest.mark.parametrize("packing,buckets", [(True, ()), (False, ()), (True, shape_buckets(128))])
def test_pairs_are_never_split_and_the_batch_names_each_pairs_samples(tokenizer, packing, buckets):
    data = tokenized(pairs_of(13), tokenizer, max_seq_len=128)
    batcher = Batcher(
        data,
        max_seq_len=128,
        micro_batch_size=2,
        packing=packing,
        seed=3,
        pad_id=tokenizer.pad_token_id,
        buckets=buckets,
    )
    rows = batcher.epoch_rows(0)
    for row in rows:  # whole pairs, side by side, chosen first
        assert len(row) % 2 == 0 and all(row[j] % 2 == 0 and row[j + 1] == row[j] + 1 for j in range(0, len(row), 2))
        assert sum(int(data.lengths[s]) for s in row) <= batcher.row_tokens == 256
    assert (max(len(r) for r in rows) > 2) == packing  # packing puts several pairs in a row, else one
    seen = []
    for batch in every_batch(batcher):
        if buckets:
            assert batch.input_ids.shape[1] in pair_shapes(buckets)
        owner, targets = batch.target_sample, batch.targets
        assert (
            owner is not None and batch.chosen is not None and batch.rejected is not None and batch.pair_ids is not None
        )
        assert torch.equal(owner >= 0, targets != IGNORE)
        counts = torch.zeros(2 * len(batch.pair_ids), dtype=torch.int64).index_add_(
            0, owner[owner >= 0], torch.ones_like(owner[owner >= 0])
        )
        for p, pair in enumerate(batch.pair_ids.tolist()):
            for s, sample in ((batch.chosen[p], 2 * pair), (batch.rejected[p], 2 * pair + 1)):
                # the targets of that batch sample are the answer tokens of that data sample
                ids, trainable = data.sample(sample)
                assert counts[s] == trainable[1:].sum()
                assert torch.equal(targets[owner == s], torch.as_tensor(ids[1:][trainable[1:]], dtype=torch.int64))
        seen += batch.pair_ids.tolist()
    assert sorted(seen) == list(range(13))  # every pair once, none in two micro-batches
    empty = batcher.empty()
    assert empty.pair_ids is not None and len(empty.pair_ids) == 0 and empty.target_tokens == 0


def test_data_parallel_shares_hold_whole_pairs(tokenizer):
    data = tokenized(pairs_of(16), tokenizer, max_seq_len=128)

    def batcher(**dp):
        return Batcher(
            data, max_seq_len=128, micro_batch_size=1, packing=True, seed=0, pad_id=tokenizer.pad_token_id, **dp
        )

    one = batcher()
    shares = [batcher(dp_rank=r, dp_size=2) for r in range(2)]
    split = [pid for s in shares for b in every_batch(s) for pid in b.pair_ids.tolist()]
    usable = len(one.epoch_rows(0)) - len(one.epoch_rows(0)) % 2  # equal shares: the odd row is left out
    expected = [s // 2 for row in one.epoch_rows(0)[:usable] for s in row[0::2]]
    assert sorted(split) == sorted(expected) and len(set(split)) == len(split)
    scoring = [batcher(dp_rank=r, dp_size=3, shuffle=False, every_row=True) for r in range(3)]  # eval's
    assert sorted(pid for s in scoring for b in every_batch(s) for pid in b.pair_ids.tolist()) == list(range(16))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dpo_recipe(path, cache, *extra):
    return load_recipe(
        None,
        [f"data.train={path}", f"data.cache_dir={cache}", "finetune.objective=dpo", "data.max_seq_len=128", *extra],
    ).recipe


def test_eval_holds_out_whole_pairs_and_keeps_the_chosen_answer_as_reference(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs_of(12))
    data = prepare_data(dpo_recipe(path, tmp_path / "cache", "data.eval=0.25"), tokenizer)
    assert data.train.pairs and data.eval is not None and data.eval.pairs
    assert (len(data.train), len(data.eval), data.eval.samples) == (9, 3, 6)
    held = {r["input"] for r in data.eval_rows}
    assert len(held) == 3 and all(
        r["output"].startswith("Fact") and "unknown" not in r["output"] for r in data.eval_rows
    )
    prompts = [data.renderer.prompt(r) for r in data.eval_rows]
    for p, row in enumerate(data.eval_rows):  # eval pair p is the held-out row p, both answers
        ids, _ = data.eval.sample(2 * p)
        assert tokenizer.decode(ids).startswith(prompts[p]) and row["output"] in tokenizer.decode(ids)
        assert "unknown" in tokenizer.decode(data.eval.sample(2 * p + 1)[0])
    train_text = tokenizer.decode(data.train.ids)
    assert not any(q in train_text for q in held)  # neither answer of a held-out pair is trained on


def test_chat_eval_rows_end_with_the_chosen_answer(tmp_path, tokenizer):
    rows = [
        {"prompt": [{"role": "user", "content": f"question {i}?"}], "chosen": f"good {i}", "rejected": f"bad {i}"}
        for i in range(4)
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    data = prepare_data(dpo_recipe(path, tmp_path, "data.eval=0.25", "data.columns.messages=prompt"), tokenizer)
    (row,) = data.eval_rows
    assert row["messages"][-1]["role"] == "assistant" and row["messages"][-1]["content"].startswith("good")
    assert data.renderer.prompt(row).endswith("<|im_start|>assistant\n")


def cache_entries(cache) -> set[str]:
    return {p.name for p in cache.iterdir() if p.is_dir()}


def test_the_cache_is_reused_on_a_rerun_and_rebuilt_when_a_chosen_answer_changes(tmp_path, tokenizer):
    rows = pairs_of(6)
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    cache = tmp_path / "cache"
    first = prepare_data(dpo_recipe(path, cache), tokenizer)
    built = cache_entries(cache)
    stamp = {n: (cache / n / "ids.npy").stat().st_mtime_ns for n in built}
    again = prepare_data(dpo_recipe(path, cache), tokenizer)
    assert cache_entries(cache) == built and {n: (cache / n / "ids.npy").stat().st_mtime_ns for n in built} == stamp
    assert again.train.pairs and same(first.train, again.train)
    write_jsonl(path, [{**rows[0], "chosen": "A different answer."}, *rows[1:]])
    changed = prepare_data(dpo_recipe(path, cache), tokenizer)
    assert len(cache_entries(cache) - built) == 1 and not same(first.train, changed.train)
    assert "A different answer." in tokenizer.decode(changed.train.sample(0)[0])


def test_only_pair_data_adds_to_the_cache_key(tokenizer):
    rows = map_pair_columns(pairs_of(2), ColumnsSection(), "data.train")
    sft = cache_key(rows, tokenizer, "chat", None, 128, True)
    assert cache_key(rows, tokenizer, "chat", None, 128, True, pairs=False) == sft
    assert cache_key(rows, tokenizer, "chat", None, 128, True, pairs=True) != sft


GOOD = {"instruction": QUESTION, "input": "", "chosen": CHOSEN, "rejected": REJECTED}


@pytest.mark.parametrize(
    "rows,columns,error",
    [
        ([{k: v for k, v in GOOD.items() if k != "chosen"}], {}, r"column `chosen` \(data.columns.chosen\) is not in"),
        ([GOOD], {"rejected": "worse"}, r"column `worse` \(data.columns.rejected\) is not in .*data.columns.rejected="),
        ([GOOD, {**GOOD, "rejected": CHOSEN}], {}, r"row 1: columns `chosen` and `rejected` hold the same answer"),
        ([GOOD, {**GOOD, "chosen": "  "}], {}, r"row 1: column `chosen` \(data.columns.chosen\) is empty"),
        ([GOOD, {**GOOD, "rejected": None}], {}, r"row 1: column `rejected` \(data.columns.rejected\) is empty"),
        ([GOOD, {k: v for k, v in GOOD.items() if k != "rejected"}], {}, r"row 1: column `rejected` .* is empty"),
        (
            [{**GOOD, "chosen": [{"role": "user", "content": "hm"}]}],
            {},
            r"row 0: column `chosen` .* must be text or a list of one assistant message",
        ),
        (
            [
                {
                    "conv": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
                    "chosen": "x",
                    "rejected": "y",
                }
            ],
            {"messages": "conv"},
            r"row 0: column `conv` ends with an assistant turn; .*the answers go in `chosen` and `rejected`",
        ),
    ],
)
def test_a_bad_pair_is_one_line_naming_the_row_the_column_and_the_fix(rows, columns, error):
    with pytest.raises(DataError, match=error) as e:
        map_pair_columns(rows, ColumnsSection(**columns), "data.train")
    assert "\n" not in str(e.value) and str(e.value).startswith("data.train: ")
