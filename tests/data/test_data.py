import json

import numpy as np
import pytest
import torch

from kubetune.data import Batcher, prepare_data
from kubetune.data.packing import IGNORE, ROW_WINDOW, order_by_length, pack_rows
from kubetune.data.sources import map_columns
from kubetune.data.templates import PromptRenderer
from kubetune.data.tokenize import load_or_build, tokenize_rows
from kubetune.errors import DataError
from kubetune.recipe import load_recipe
from kubetune.recipe.schema import ColumnsSection

ROW = {
    "instruction": "Answer this question truthfully",
    "input": "What does insulin do?",
    "output": "Insulin lowers blood glucose.",
}


def test_labels_only_on_the_response_and_one_eos(tokenizer):
    renderer = PromptRenderer("chat", tokenizer)
    data = tokenize_rows([ROW, {**ROW, "output": ROW["output"] + tokenizer.eos_token}], renderer, tokenizer, 256, True)
    prompt_ids = tokenizer(renderer.prompt(ROW), add_special_tokens=False)["input_ids"]
    for i in range(2):
        ids, trainable = data.sample(i)
        assert list(ids[: len(prompt_ids)]) == prompt_ids
        assert not trainable[: len(prompt_ids)].any()
        assert trainable[len(prompt_ids) :].all()
        assert ids[-1] == tokenizer.eos_token_id
        response = ids[len(prompt_ids) :]
        assert (response == tokenizer.eos_token_id).sum() == 1  # exactly once, even if the data had one
        assert tokenizer.decode(response[:-1]) == ROW["output"]


@pytest.mark.parametrize(
    "template,expect",
    [
        ("alpaca", "### Instruction:\nAnswer this question truthfully\n\n### Input:\nWhat does insulin do?"),
        ("llama2", "[INST] Answer this question truthfully\n\nWhat does insulin do? [/INST]"),
        ("Q: {input}\nA: ", "Q: What does insulin do?\nA: "),
        ("chat", "<|im_start|>user\nAnswer this question truthfully\n\nWhat does insulin do?<|im_end|>"),
    ],
)
def test_templates(tokenizer, template, expect):
    assert expect in PromptRenderer(template, tokenizer).prompt(ROW)


def test_messages_column_trains_on_the_last_assistant_turn(tokenizer):
    rows = map_columns(
        [{"conv": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}],
        ColumnsSection(messages="conv"),
        "data.train",
    )
    prompt, response = PromptRenderer("chat", tokenizer).render(rows[0])
    assert prompt.endswith("<|im_start|>assistant\n") and "Hi?" in prompt and response == "Hello."


def test_missing_column_names_the_key_and_the_columns():
    with pytest.raises(DataError) as exc:
        map_columns([{"question": "q", "answer": "a"}], ColumnsSection(), "data.train")
    msg = str(exc.value)
    assert "data.columns.instruction" in msg and "answer, question" in msg


def test_prompt_longer_than_max_seq_len_is_a_clear_error(tokenizer):
    with pytest.raises(DataError, match=r"data\.max_seq_len=16"):
        tokenize_rows([ROW], PromptRenderer("chat", tokenizer), tokenizer, 16, True)


def test_long_responses_are_truncated_but_keep_their_eos(tokenizer):
    long = {**ROW, "output": "word " * 500}
    data = tokenize_rows([long], PromptRenderer("chat", tokenizer), tokenizer, 128, True)
    ids, _ = data.sample(0)
    assert len(ids) == 128 and ids[-1] == tokenizer.eos_token_id


def test_packing_fills_rows_without_splitting_or_losing_samples():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 200, size=300)
    rows = pack_rows(lengths, rng.permutation(300), 512)
    seen = sorted(i for row in rows for i in row)
    assert seen == list(range(300))
    assert all(sum(lengths[i] for i in row) <= 512 for row in rows)
    fill = lengths.sum() / (len(rows) * 512)
    assert fill > 0.9, fill


def test_rows_are_ordered_by_length_within_windows_only():
    rng = np.random.default_rng(1)
    lengths = rng.integers(10, 200, size=400)
    rows = pack_rows(lengths, rng.permutation(400), 512)
    ordered = order_by_length(rows, lengths)
    tokens = [sum(lengths[i] for i in row) for row in ordered]
    for start in range(0, len(rows), ROW_WINDOW):
        window = slice(start, start + ROW_WINDOW)
        assert sorted(map(tuple, ordered[window])) == sorted(map(tuple, rows[window]))
        assert tokens[window] == sorted(tokens[window], reverse=True)
    assert order_by_length([[0], [1], [2]], np.array([5, 5, 5])) == [[0], [1], [2]]  # ties keep their order


def _rank_wait(batcher_rows: list[list[int]], lengths: np.ndarray, dp: int) -> float:
    """Over a perfectly even split, the share of the steps' time spent waiting for the rank
    with the most tokens (one row per rank and step)."""
    tokens = np.array([sum(lengths[i] for i in row) for row in batcher_rows])
    steps = tokens[: len(tokens) // dp * dp].reshape(-1, dp)
    return float(steps.max(1).sum() / steps.mean(1).sum() - 1)


def test_ranks_of_a_step_get_rows_of_about_the_same_length(tokenizer):
    data = _data(tokenizer, n=400)
    kw = {"max_seq_len": 256, "micro_batch_size": 1, "packing": True, "pad_id": 0}
    for seed in range(3):
        rows = Batcher(data, seed=seed, **kw).epoch_rows(0)
        packed = pack_rows(data.unit_lengths, np.random.default_rng([seed, 0]).permutation(len(data)), 256)
        assert sorted(map(tuple, rows)) == sorted(map(tuple, packed))  # the same rows, in another order
        for dp in (2, 4):
            assert _rank_wait(rows, data.lengths, dp) < 0.6 * _rank_wait(packed, data.lengths, dp)
    # evaluation keeps the packed order
    assert Batcher(data, seed=0, shuffle=False, **kw).epoch_rows(0) == pack_rows(
        data.unit_lengths, np.arange(len(data)), 256
    )


def _data(tokenizer, n=40):
    rows = [{**ROW, "input": f"Question {i}?", "output": "answer " * (1 + i % 13)} for i in range(n)]
    return tokenize_rows(rows, PromptRenderer("chat", tokenizer), tokenizer, 256, True)


def test_batches_are_deterministic_and_targets_never_cross_samples(tokenizer):
    data = _data(tokenizer)

    def make() -> Batcher:
        return Batcher(data, max_seq_len=256, micro_batch_size=2, packing=True, seed=7, pad_id=0)

    b1, _ = make().micro_batch(0, 0)
    b2, _ = make().micro_batch(0, 0)
    assert torch.equal(b1.input_ids, b2.input_ids)
    flat_t, flat_p = b1.targets.flatten(), b1.position_ids.flatten()
    starts = set(b1.cu_seqlens[:-1])
    for j in range(len(flat_t) - 1):
        if flat_t[j] != IGNORE:
            assert (j + 1) not in starts  # the target of the last token of a sample is never the next sample
            assert flat_p[j + 1] == flat_p[j] + 1
    other_epoch, _ = make().micro_batch(1, 0)
    assert other_epoch.input_ids.shape != b1.input_ids.shape or not torch.equal(other_epoch.input_ids, b1.input_ids)


def test_consumed_rows_are_a_prefix_for_any_world_size(tokenizer):
    data = _data(tokenizer)
    kw = {"max_seq_len": 256, "micro_batch_size": 2, "packing": True, "seed": 3, "pad_id": 0}
    two = [Batcher(data, dp_rank=r, dp_size=2, **kw) for r in range(2)]
    one = Batcher(data, **kw)
    # two ranks take one micro-batch each: rows 0..3; one process resumes at row 4
    seen = set()
    for b in two:
        batch, nxt = b.micro_batch(0, 0)
        seen.update(batch.input_ids[:, 0].tolist())
    assert nxt == 4
    resumed, _ = one.micro_batch(0, 4)
    rows = one.epoch_rows(0)
    expected = one.collate(rows[4:6])
    assert torch.equal(resumed.input_ids, expected.input_ids)


@pytest.mark.parametrize("dp", [2, 4])
def test_evaluation_scores_every_row_whatever_the_world_size(tokenizer, dp):
    data = _data(tokenizer, n=41)
    kw = {"max_seq_len": 256, "micro_batch_size": 1, "packing": True, "seed": 0, "pad_id": 0, "shuffle": False}
    n_rows = len(Batcher(data, **kw).epoch_rows(0))
    assert n_rows % dp, "the test needs rows that do not split evenly"
    ranks = [Batcher(data, dp_rank=r, dp_size=dp, every_row=True, **kw) for r in range(dp)]
    counts = {b.micro_batches_left(0) for b in ranks}
    assert len(counts) == 1  # every rank runs the same number of forwards (FSDP, TP need it)
    scored, empty = 0, 0
    for b in ranks:
        row = 0
        while b.micro_batches_left(0, row):
            batch, row = b.micro_batch(0, row)
            scored += batch.target_tokens
            empty += batch.real_tokens == 0
    whole = Batcher(data, **kw)
    expected, row = 0, 0
    while whole.micro_batches_left(0, row):
        batch, row = whole.micro_batch(0, row)
        expected += batch.target_tokens
    assert scored == expected and empty >= 1
    dropping = Batcher(data, dp_rank=0, dp_size=dp, **kw)  # training's batcher keeps equal shares
    assert dropping.usable_rows(0) == n_rows - n_rows % dp


def test_tokenized_cache_is_reused(tmp_path, tokenizer):
    calls = []

    def build():
        calls.append(1)
        return _data(tokenizer, 5)

    a = load_or_build(tmp_path, "k", build)
    b = load_or_build(tmp_path, "k", build)
    assert len(calls) == 1 and np.array_equal(a.ids, b.ids) and np.array_equal(a.offsets, b.offsets)


def test_prepare_data_splits_deterministically_and_checks_input(tmp_path, tokenizer, qa_file):
    r = load_recipe(None, [f"data.train={qa_file}", "data.eval=0.25", f"data.cache_dir={tmp_path}"]).recipe
    d1, d2 = prepare_data(r, tokenizer), prepare_data(r, tokenizer)
    assert len(d1.train) == 36 and len(d1.eval) == 12
    assert d1.eval_rows == d2.eval_rows
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        prepare_data(load_recipe(None, [f"data.train={empty}"]).recipe, tokenizer)
    with pytest.raises(DataError, match="file not found"):
        prepare_data(load_recipe(None, [f"data.train={tmp_path}/nope.jsonl"]).recipe, tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROW) + "\n{oops\n")
    with pytest.raises(DataError, match="line 2"):
        prepare_data(load_recipe(None, [f"data.train={bad}"]).recipe, tokenizer)


SEED_002_TEMPLATE = "你是一个专业的医疗助手。请根据问题给出准确的回答。\n问题:{input}\n回答:"


@pytest.mark.parametrize(
    "row,expect",
    [
        (ROW, "问题:What does insulin do?\n回答:"),  # instruction + input: the input is the question
        ({"instruction": "", "input": "胰岛素的作用是什么?"}, "问题:胰岛素的作用是什么?\n回答:"),
        # instruction-only rows (and `kubetune generate`, which passes the prompt as the instruction)
        ({"instruction": "胰岛素的作用是什么?", "input": ""}, "问题:胰岛素的作用是什么?\n回答:"),
    ],
)
def test_an_input_only_template_asks_the_rows_question(tokenizer, row, expect):
    prompt = PromptRenderer(SEED_002_TEMPLATE, tokenizer).prompt(row)
    assert prompt == SEED_002_TEMPLATE.split("问题:")[0] + expect


def test_an_instruction_only_template_keeps_the_input(tokenizer):
    assert PromptRenderer("Q: {instruction}\nA:", tokenizer).prompt(ROW) == (
        "Q: Answer this question truthfully\n\nWhat does insulin do?\nA:"
    )
    both = PromptRenderer("{instruction} | {input} {{json}}", tokenizer).prompt({**ROW, "input": ""})
    assert both == "Answer this question truthfully |  {json}"


@pytest.mark.parametrize(
    "template,error",
    [
        ("Question: {question}", r"data\.template`: .*only \{instruction\} and \{input\}, not \{question\}"),
        ("no placeholder", r"data\.template`: .*must contain \{input\} or \{instruction\}"),
        ('Reply in JSON: {"q": {input}}', r"data\.template`: .*literal brace as \{\{ or \}\}"),
        ("ask {input", r"data\.template`: .*format string"),
    ],
)
def test_a_bad_custom_template_is_one_line_naming_the_fix(template, error):
    from kubetune.errors import RecipeError

    with pytest.raises(RecipeError, match=error) as exc:
        load_recipe(None, [f"data.template={template}"])
    assert "\n" not in str(exc.value).strip()


def test_input_only_data_needs_no_instruction_column(tokenizer):
    rows = map_columns([{"input": "胰岛素?", "output": "降血糖。"}], ColumnsSection(), "data.train")
    assert rows == [{"instruction": "", "input": "胰岛素?", "output": "降血糖。"}]
    for template, expect in [("alpaca", "### Instruction:\n胰岛素?\n\n### Response:"), ("chat", "user\n胰岛素?<")]:
        assert expect in PromptRenderer(template, tokenizer).prompt(rows[0])


def test_a_step_beyond_an_epoch_is_warned_about(tokenizer, qa_file, tmp_path):
    """A global batch larger than the packed rows of an epoch makes every epoch one optimizer step."""
    from kubetune.data import prepare_data
    from kubetune.recipe import load_recipe
    from kubetune.training.parallel import single_process
    from kubetune.training.setup import batch_warnings, train_batcher

    common = [f"data.train={qa_file}", "data.max_seq_len=128", f"data.cache_dir={tmp_path}", "train.micro_batch_size=2"]
    common.append("train.grad_accum=1")  # derived from the global batch
    recipe = load_recipe(None, [*common, "train.global_batch_size=4096"]).recipe
    batcher = train_batcher(recipe, prepare_data(recipe, tokenizer), tokenizer.pad_token_id, single_process())
    rows = len(batcher.epoch_rows(0))
    (line,) = batch_warnings(recipe, batcher, single_process())
    assert line.startswith(f"a step of 4096 rows (train.global_batch_size) is more than the {rows} rows of an epoch")
    assert line.endswith(f"every epoch is one optimizer step; lower train.global_batch_size to at most {rows}")
    fits = load_recipe(None, [*common, "train.global_batch_size=4"]).recipe
    assert batch_warnings(fits, batcher, single_process()) == []
