"""GRPO's rewards: the built-ins against hand-computed values, the recipe's spec refused one line per
problem, user functions by import path, and scoring called and weighed as TRL's GRPOTrainer does."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest

from kubetune.errors import RecipeError, UserError
from kubetune.training.rewards import RewardError, build_rewards, check_columns, score


def rewards_of(spec, completions, **columns):
    """One built-in's rewards, as the trainer gets them through `score` (NaN for None)."""
    funcs = build_rewards([spec])
    return [row[0] for row in score(funcs, ["q"] * len(completions), completions, columns).per_function]


def same(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert (math.isnan(g) and math.isnan(e)) or g == pytest.approx(e), (got, expected)


# --- the built-ins -----------------------------------------------------------------------------------


def test_accuracy_compares_numbers_after_commas_and_whitespace_and_text_without_case():
    completions = ["1,234", " 1234.\n", "1234.0000001", "1235", "The answer is 1234", "paris.", "Lyon", "7", "1,2"]
    answers = [1234, "1,234", "1234", "1234", "1234", "Paris", "Paris", None, "12"]
    same(rewards_of("accuracy", completions, answer=answers), [1, 1, 1, 0, 0, 1, 0, math.nan, 0])


def test_accuracy_reads_the_last_match_of_its_pattern_and_its_answer_group():
    spec = {"name": "accuracy", "options": {"pattern": r"answer:\s*(?P<answer>\S+)", "column": "gold"}}
    completions = ["answer: 3 ... no, answer: 4", "answer: 3", "no answer here", "ANSWER: 4"]
    same(rewards_of(spec, completions, gold=["4"] * 4), [1, 0, 0, 0])
    grouped = {"name": "accuracy", "options": {"pattern": r"<a>(.*?)</a>", "compare": "exact"}}
    same(rewards_of(grouped, ["<a>12</a> then <a>012</a>"], answer=["12"]), [0])  # exact: "012" != "12"
    same(rewards_of({**grouped, "options": {"pattern": r"<a>(.*?)</a>"}}, ["<a>012</a>"], answer=["12"]), [1])


def test_accuracy_tolerance_is_relative_above_one_and_absolute_below():
    spec = {"name": "accuracy", "options": {"tolerance": 0.01}}
    same(rewards_of(spec, ["1009", "1011", "0.009", "0.011"], answer=["1000", "1000", "0", "0"]), [1, 0, 1, 0])


def test_format_matches_the_whole_stripped_completion_or_anywhere():
    full = {"name": "format", "options": {"pattern": r"<think>.*</think>\s*\d+"}}
    completions = ["<think>a\nb</think> 42\n", "<think>x</think> 42 and more", "42"]
    same(rewards_of(full, completions), [1, 0, 0])
    search = {"name": "format", "options": {"pattern": r"<think>.*</think>\s*\d+", "match": "search"}}
    same(rewards_of(search, completions), [1, 1, 0])


def test_length_falls_linearly_beyond_the_target_and_stops_at_minus_one():
    spec = {"name": "length", "options": {"target": 10}}
    same(rewards_of(spec, ["x" * 4, "x" * 10, "x" * 15, "x" * 20, "x" * 50]), [0, 0, -0.5, -1, -1])
    both = {"name": "length", "options": {"target": 10, "scale": 4, "only_longer": False}}
    same(rewards_of(both, ["x" * 8, "x" * 11]), [-0.5, -0.25])


def test_length_in_tokens_counts_the_completion_ids():
    funcs = build_rewards([{"name": "length", "options": {"target": 2, "unit": "tokens"}}])
    scores = score(funcs, ["q", "q"], ["a very long text", "b"], {}, completion_ids=[[1, 2], [1, 2, 3, 4]])
    same([r[0] for r in scores.per_function], [0, -1])
    with pytest.raises(RewardError, match=r"reward `length` failed on dataset row 0: .*token ids"):
        score(funcs, ["q"], ["a"], {})


def test_token_f1_is_squad_s():
    # "the cat sat" -> [cat, sat]; "a cat sat down" -> [cat, sat, down]: P = 1, R = 2/3, F1 = 0.8
    same(
        rewards_of(
            "token_f1",
            ["the cat sat", "A cat, sat down!", "dog", "", "x"],
            answer=["a cat sat down", "cat sat down", "cat", "", None],
        ),
        [0.8, 1, 0, 1, math.nan],
    )
    raw = {"name": "token_f1", "options": {"normalize": False}}
    same(rewards_of(raw, ["The cat cat"], answer=["cat"]), [0.5])  # P = 1/3, R = 1: 2 * (1/3) / (4/3)


def test_json_schema_validates_against_the_option_or_the_row_and_reads_inside_a_fence():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spec = {"name": "json_schema", "options": {"schema": schema}}
    completions = ['{"n": 3}', '```json\n{"n": 3}\n```', '{"n": "3"}', "{n: 3}", "[]"]
    same(rewards_of(spec, completions), [1, 1, 0, 0, 0])
    per_row = {"name": "json_schema", "options": {"column": "schema"}}
    schemas = [json.dumps({"type": "array"}), {"type": "string"}]
    same(rewards_of(per_row, ["[1]", "[1]"], schema=schemas), [1, 0])
    same(rewards_of("json_schema", ['{"any": 1}', "not json"]), [1, 0])


def test_built_ins_read_chat_completions_as_trl_hands_them():
    completions = [[{"role": "assistant", "content": "42"}], [{"role": "assistant", "content": "41"}]]
    same(rewards_of("accuracy", completions, answer=["42", "42"]), [1, 0])


# --- the recipe's spec ---------------------------------------------------------------------------------


def test_the_spec_builds_named_weighted_functions_in_order():
    funcs = build_rewards(
        [
            "accuracy",
            {"name": "format", "options": {"pattern": r"\d+"}},
            {"name": "format", "options": {"pattern": "x"}},
        ],
        [2, 0.5, 1],
    )
    assert [(f.name, f.weight) for f in funcs] == [("accuracy", 2.0), ("format", 0.5), ("format_2", 1.0)]
    assert [f.weight for f in build_rewards(["accuracy", "token_f1"])] == [1.0, 1.0]


def test_every_problem_of_the_spec_is_one_line_naming_its_key_and_the_fix():
    with pytest.raises(RecipeError) as e:
        build_rewards(
            [
                "acuracy",
                {"name": "format"},
                {"name": "accuracy", "options": {"colum": "x", "tolerance": "small", "compare": "fuzzy"}},
                {"name": "length", "options": {"target": 0}},
                {"name": "format", "weight": 2},
            ],
            [1, 1],
        )
    assert e.value.problems == [
        (
            "finetune.rl.reward_funcs[0]: unknown reward `acuracy`; did you mean `accuracy`? "
            "(or a function as `module:function`)"
        ),
        "finetune.rl.reward_funcs[1]: reward `format` needs the option `pattern`",
        "finetune.rl.reward_funcs[2]: reward `accuracy` has no option `colum`; did you mean `column`?",
        "finetune.rl.reward_funcs[2].options.tolerance: got 'small', expected float",
        "finetune.rl.reward_funcs[2].options.compare: got 'fuzzy', expected 'auto' | 'exact' | 'numeric'",
        "finetune.rl.reward_funcs[3]: reward `length`: `target` must be > 0, got 0",
        "finetune.rl.reward_funcs[4]: unknown key `weight`; an entry has `name` and `options`",
        (
            "finetune.rl.reward_weights: 2 weight(s) for 5 reward function(s) in finetune.rl.reward_funcs; "
            "give one weight per function, in the same order (or leave it out: 1.0 each)"
        ),
    ]


@pytest.mark.parametrize(
    ("spec", "weights", "message"),
    [
        ([], None, r"reward_funcs: no reward function; name at least one"),
        (["accuracy"], [float("nan")], r"reward_weights\[0\]: got nan, expected a finite number"),
        (["accuracy"], [True], r"reward_weights\[0\]: got True, expected a finite number"),
        ([{"name": "accuracy", "options": {"pattern": "("}}], None, r"`pattern` is not a valid regular expression"),
        ([{"name": "json_schema", "options": {"schema": {"type": 3}}}], None, r"not a valid JSON Schema"),
        ([{"name": "json_schema", "options": {"schema": {}, "column": "s"}}], None, r"give `schema` or `column`"),
        ([42], None, r"reward_funcs\[0\]: give a name, `module:function`"),
    ],
)
def test_bad_specs_are_refused(spec, weights, message):
    with pytest.raises(RecipeError, match=message) as e:
        build_rewards(spec, weights)
    assert len(e.value.problems) == 1


def test_a_missing_reference_column_is_named_before_the_first_rollout():
    funcs = build_rewards(["accuracy", {"name": "token_f1", "options": {"column": "gold"}}, "json_schema"])
    with pytest.raises(RecipeError) as e:
        check_columns(funcs, ["prompt", "gold"])
    assert e.value.problems == [
        (
            "data.train: reward `accuracy` reads column `answer`, which the data lacks (columns: gold, prompt); "
            "set its option `column`, or add the column"
        )
    ]
    check_columns(funcs, ["prompt", "gold", "answer"])


# --- user functions by import path ---------------------------------------------------------------------

USER_MODULE = """
calls = []

def exact(prompts, completions, answer, **kwargs):
    calls.append(sorted(kwargs))
    return [float(c == a) for c, a in zip(completions, answer)]

count = 3

async def judge(prompts, completions, **kwargs):
    return [1.0 for _ in completions]
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    (tmp_path / "broken_rewards.py").write_text("import math\nmath.sqrt(-1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    for name in ("my_rewards", "broken_rewards"):
        sys.modules.pop(name, None)


def test_a_user_function_is_imported_named_as_trl_names_it_and_called_with_the_columns(user_module):
    (reward,) = build_rewards(["my_rewards:exact"], [3])
    assert (reward.name, reward.weight) == ("exact", 3.0)
    scores = score([reward], ["p", "p"], ["4", "5"], {"answer": ["4", "4"], "prompt": ["p", "p"], "level": [1, 2]})
    assert scores.total == [3.0, 0.0]
    assert sys.modules["my_rewards"].calls == [["level"]]  # `prompt` stays out, as in TRL


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module_here:f", r"cannot import `no_such_module_here` for `no_such_module_here:f` \(No module named"),
        ("my_rewards:exakt", r"`my_rewards` has no `exakt`; did you mean `exact`\?"),
        ("my_rewards:count", r"`my_rewards:count` is a int, not a function; point it at a function"),
        ("broken_rewards:f", r"importing `broken_rewards` for `broken_rewards:f` failed: ValueError: math domain"),
        ("my_rewards:", r"`my_rewards:` is not `module:function`"),
        ("my_rewards:judge", r"`my_rewards:judge` is async; kubetune calls reward functions synchronously"),
    ],
)
def test_an_import_path_that_does_not_lead_to_a_function_is_one_line_with_the_fix(user_module, path, message):
    with pytest.raises(RecipeError, match=rf"^finetune.rl.reward_funcs\[0\]: {message}") as e:
        build_rewards([path])
    assert len(e.value.problems) == 1 and "\n" not in str(e.value)


def test_options_are_refused_for_a_user_function(user_module):
    with pytest.raises(RecipeError, match="`options` are for the built-in rewards"):
        build_rewards([{"name": "my_rewards:exact", "options": {"x": 1}}])


# --- scoring -------------------------------------------------------------------------------------------


def test_none_is_left_out_of_the_weighted_sum_and_a_row_nobody_scores_is_nan():
    def only_even(prompts, completions, **columns):
        return [1.0 if i % 2 == 0 else None for i in columns["i"]]

    def never(prompts, completions, **columns):
        return [None if i < 2 else 0.25 for i in columns["i"]]

    from kubetune.training.rewards import Reward

    funcs = [Reward("only_even", only_even, 2.0), Reward("never", never, -4.0)]
    scores = score(funcs, ["q"] * 4, ["c"] * 4, {"i": [0, 1, 2, 3]})
    same([v for row in scores.per_function for v in row], [1, math.nan, math.nan, math.nan, 1, 0.25, math.nan, 0.25])
    same(scores.total, [2.0, math.nan, 1.0, -1.0])


def test_the_matrix_and_totals_equal_trl_s_for_the_same_call():
    """TRL's own `_calculate_rewards` on the same rows, and its weighting (`nansum`, NaN where every
    function returned None), against `score`: the same kwargs reach the function, the same numbers
    come back."""
    torch = pytest.importorskip("torch")
    from accelerate import Accelerator
    from transformers import TrainerState
    from trl import GRPOTrainer

    seen: dict[str, list[str]] = {}

    def by_length(prompts, completions, completion_ids, **columns):
        seen.setdefault("trl" if "trainer_state" in columns else "kubetune", sorted(columns))
        return [None if c == "skip" else len(ids) / 4 for c, ids in zip(completions, completion_ids)]

    accuracy = build_rewards(["accuracy"])[0].func
    rows = [{"prompt": "p0", "answer": "12", "level": 1}, {"prompt": "p1", "answer": None, "level": 2}] * 2
    completions, ids = ["12", "skip", "13", "skip"], [[1, 2], [3], [4, 5, 6], [7]]
    weights = [0.5, 2.0]

    trainer = object.__new__(GRPOTrainer)  # only what `_calculate_rewards` reads
    trainer.accelerator = Accelerator(cpu=True)
    trainer.args, trainer.state, trainer.environments = type("Args", (), {"report_to": []})(), TrainerState(), None
    trainer.reward_funcs, trainer.reward_processing_classes = [by_length, accuracy], [None, None]
    trainer.reward_func_names = ["by_length", "accuracy"]
    trainer._log_completion_extra = trainer._log_metric = lambda *args: None
    prompts = [r["prompt"] for r in rows]
    trl_matrix = trainer._calculate_rewards(rows, prompts, completions, ids)
    trl_total = (trl_matrix * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
    trl_total[torch.isnan(trl_matrix).all(dim=1)] = torch.nan  # TRL's unscorable rows

    from kubetune.training.rewards import Reward

    funcs = [Reward("by_length", by_length, weights[0]), Reward("accuracy", accuracy, weights[1])]
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    ours = score(funcs, prompts, completions, columns, completion_ids=ids)
    same([v for row in ours.per_function for v in row], trl_matrix.flatten().tolist())
    same(ours.total, trl_total.tolist())
    assert seen["kubetune"] == [c for c in seen["trl"] if c not in ("trainer_state", "log_extra", "log_metric")]


def test_a_function_that_raises_names_itself_and_the_first_row_that_fails():
    def picky(prompts, completions, **columns):
        return [1.0 / len(c) for c in completions]

    from kubetune.training.rewards import Reward

    with pytest.raises(RewardError) as e:
        score([Reward("picky", picky, 1.0)], ["q"] * 4, ["a", "bb", "", "d"], {}, rows=[40, 40, 41, 41])
    assert str(e.value) == "reward `picky` failed on dataset row 41: ZeroDivisionError: float division by zero"
    assert isinstance(e.value, UserError)


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([1.0, float("nan")], r"^reward `f` returned nan on dataset row 8; return a finite float, or None to skip"),
        ([float("-inf"), 1.0], r"^reward `f` returned -inf on dataset row 7;"),
        ([1.0], r"^reward `f` returned 1 rewards for 2 completions \(dataset rows 7..8\); return one float or None"),
        (["1.0", 2], r"^reward `f` returned '1.0' on dataset row 7; return a float or None"),
        (1.0, r"^reward `f` returned a float for dataset rows 7..8; return a list"),
    ],
)
def test_a_function_that_returns_nan_inf_or_the_wrong_shape_stops_with_one_line(returned, message):
    from kubetune.training.rewards import Reward

    with pytest.raises(RewardError, match=message) as e:
        score([Reward("f", lambda prompts, completions, **c: returned, 1.0)], ["q", "q"], ["a", "b"], {}, rows=[7, 8])
    assert "\n" not in str(e.value)


def test_a_bad_schema_in_a_row_is_named_with_its_row():
    funcs = build_rewards([{"name": "json_schema", "options": {"column": "schema"}}])
    with pytest.raises(RewardError, match=r"^reward `json_schema` failed on dataset row 5: ValueError: the schema"):
        score(funcs, ["q", "q"], ["1", "1"], {"schema": ['{"type": "integer"}', "{not json"]}, rows=[4, 5])


@pytest.mark.process
def test_scoring_runs_where_torch_cannot_be_imported():
    program = textwrap.dedent(
        """
        import sys
        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers", "numpy"):
                    raise ImportError(f"{name} refused")
        sys.meta_path.insert(0, Refuse())
        from kubetune.training.rewards import build_rewards, score
        funcs = build_rewards(["accuracy", {"name": "json_schema", "options": {"schema": {"type": "integer"}}}])
        print(score(funcs, ["q"], ["3"], {"answer": ["3"]}).total)
        """
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[2.0]"
