"""kubetune's engine as an lm-eval backend against lm-eval's own HFLM on the suite's tiny Llama:
the same log-likelihoods (within float noise: the engine fuses q/k/v into one GEMM), the same
is_greedy, rolling sums and greedy generations, directly and through lm-eval's own evaluator
on the shipped flashcards tasks."""

from __future__ import annotations

import pytest

from tests.kit.paths import REPO

lm_eval = pytest.importorskip("lm_eval")

CONTEXTS = [
    "Question: what is 2+2?\nAnswer:",
    "The capital of France is",
    "Hello world, this is a long",
    "Question: what is 2+2?\nAnswer:",  # a context scored twice: the second reads it from the prefix cache
]
CONTINUATIONS = [" 4", " Paris, of course", " sentence.", " five"]


@pytest.fixture(scope="module")
def both(tiny_model_dir):
    from lm_eval.models.huggingface import HFLM

    from kubetune.training.lmeval import EngineLM

    return HFLM(pretrained=str(tiny_model_dir), dtype="float32", batch_size=4, device="cpu"), EngineLM(
        pretrained=str(tiny_model_dir)
    )


def instances(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihoods_match_hflm(both):
    hf, kt = both
    requests = instances("loglikelihood", [*zip(CONTEXTS, CONTINUATIONS), ("", "Just a continuation")])
    expected, got = hf.loglikelihood(requests), kt.loglikelihood(requests)
    assert [g for _, g in got] == [g for _, g in expected]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in expected], abs=1e-3)


def test_greedy_flag_matches_hflm_where_the_continuation_is_the_models_own(both):
    """A continuation made of the model's own greedy tokens: is_greedy True for both."""
    hf, kt = both
    context = "The capital of France is"
    own = hf.generate_until(instances("generate_until", [(context, {"until": [], "max_gen_toks": 5})]))[0]
    requests = instances("loglikelihood", [(context, own)])
    assert hf.loglikelihood(requests)[0][1] is True
    assert kt.loglikelihood(requests)[0][1] is True


def test_rolling_loglikelihood_matches_hflm_over_several_windows(both, tiny_model_dir):
    from kubetune.training.lmeval import EngineLM

    hf, _ = both
    short = EngineLM(pretrained=str(tiny_model_dir), max_length=64)  # several windows of 64 tokens
    hf._max_length = 64
    try:
        requests = instances("loglikelihood_rolling", [("some text to score " * 30,), ("a short one",)])
        assert short.loglikelihood_rolling(requests) == pytest.approx(hf.loglikelihood_rolling(requests), abs=1e-3)
    finally:
        hf._max_length = None


def test_greedy_generations_equal_hflms_and_stop_at_until(both):
    hf, kt = both
    requests = instances(
        "generate_until",
        [(c, {"until": ["\n\n", "."], "max_gen_toks": 24, "do_sample": False}) for c in CONTEXTS]
        + [(CONTEXTS[1], {"until": [" is"], "max_gen_toks": 24})],
    )
    expected, got = hf.generate_until(requests), kt.generate_until(requests)
    assert got == expected
    assert " is" not in got[-1]


def test_shipped_tasks_through_lm_evals_evaluator_equal_hflms(both):
    """flashcards (generate_until: exact match, ROUGE-L) and flashcards_mc (acc, acc_norm) offline,
    through lm-eval's simple_evaluate, with the numbers HFLM gives."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from kubetune.training.lmeval import shipped_tasks

    hf, kt = both
    tasks = TaskManager(include_path=str(shipped_tasks()))
    run = {"tasks": ["flashcards", "flashcards_mc"], "task_manager": tasks, "limit": 4, "apply_chat_template": True}
    got, expected = simple_evaluate(model=kt, **run)["results"], simple_evaluate(model=hf, **run)["results"]
    assert set(got["flashcards"]) >= {"exact_match,none", "rougeL,none"}
    assert set(got["flashcards_mc"]) >= {"acc,none", "acc_norm,none"}
    for task in got:
        numbers = {k: v for k, v in got[task].items() if isinstance(v, float)}
        assert numbers == pytest.approx({k: expected[task][k] for k in numbers}, abs=1e-6)


def test_registered_as_kubetune_for_lm_evals_own_cli():
    from lm_eval.api.registry import get_model

    from kubetune.training import lmeval

    assert get_model("kubetune") is lmeval.EngineLM


def test_task_data_is_the_quick_starts_held_out_rows():
    """The shipped rows are what scripts/make_flashcards_tasks.py writes (its --check): the rows
    the Quick start's data.eval=0.1 holds out, none of them trained on; each with its answer
    among 4 choices at `label`."""
    import importlib.util
    import json

    from kubetune.data import split_rows
    from kubetune.data.sources import load_rows

    spec = importlib.util.spec_from_file_location("make_tasks", REPO / "scripts" / "make_flashcards_tasks.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.OUT.read_text() == script.text()
    shipped = [json.loads(line) for line in script.OUT.read_text().splitlines()]
    train, held = split_rows(load_rows("builtin:medical_flashcards_sample", "train", "data.train"), 0.1)
    assert [r["input"] for r in shipped] == [r["input"] for r in held]
    assert not {r["input"] for r in shipped} & {r["input"] for r in train}
    assert all(len(r["choices"]) == 4 and r["choices"][r["label"]] == r["output"] for r in shipped)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model_dir):
    """A LoRA run of the suite's tiny recipe, 2 steps."""
    from kubetune.training.run import train_from_recipe
    from tests.conftest import tiny_recipe, write_qa_file

    where = tmp_path_factory.mktemp("lmeval-run")
    overrides = tiny_recipe(tiny_model_dir, write_qa_file(where / "qa.jsonl"), where / "cache")
    out = where / "run"
    train_from_recipe(None, [*overrides, "train.max_steps=2", "eval.generate=0", f"output_dir={out}"])
    return out


def test_eval_tasks_prints_base_vs_tuned_and_writes_summary(tiny_run, capfd):
    import json

    from tests.kit.cli import run_cli_in_process

    done = run_cli_in_process(["eval", str(tiny_run), "--tasks", "flashcards,flashcards_mc", "--limit", "3"], capfd)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if "flashcards" in ln]
    assert any("rougeL" in ln for ln in lines) and any("acc_norm" in ln for ln in lines)
    assert "base" in done.stdout and "tuned" in done.stdout
    found = json.loads((tiny_run / "summary.json").read_text())["lm_eval"]
    assert set(found) == {"flashcards", "flashcards_mc"}
    for metrics in found.values():
        for pair in metrics.values():
            assert set(pair) == {"base", "tuned"} and all(isinstance(v, float) for v in pair.values())


@pytest.mark.parametrize(
    ("tasks", "says"),
    [
        ("no_such_task_xyz", "--tasks no_such_task_xyz: not an lm-eval task"),
        ("missing/tasks.yaml", "--tasks missing/tasks.yaml: no such file"),
        pytest.param(  # HF_HUB_OFFLINE=1 (tests/conftest.py)
            "arc_easy", "--tasks arc_easy: its data could not be fetched", marks=pytest.mark.slow
        ),
    ],
)
def test_bad_tasks_one_line_exit_2(tiny_run, capfd, tasks, says):
    from tests.kit.cli import run_cli_in_process

    done = run_cli_in_process(["eval", str(tiny_run), "--tasks", tasks], capfd)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("kubetune: error")]
    assert done.returncode == 2 and len(errors) == 1 and says in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # CI's time: a further combination of what the default suite covers
def test_a_local_task_yaml_file(tiny_run, tmp_path, capfd):
    """A task YAML outside kubetune (here: a copy of flashcards_mc under another name)."""
    from kubetune.training.lmeval import shipped_tasks
    from tests.kit.cli import run_cli_in_process

    text = (shipped_tasks() / "flashcards_mc.yaml").read_text().replace("task: flashcards_mc", "task: my_cards")
    (tmp_path / "my_cards.yaml").write_text(text)
    (tmp_path / "flashcards_utils.py").write_text((shipped_tasks() / "flashcards_utils.py").read_text())
    (tmp_path / "flashcards_heldout.jsonl").write_text((shipped_tasks() / "flashcards_heldout.jsonl").read_text())
    done = run_cli_in_process(
        ["eval", str(tiny_run), "--tasks", str(tmp_path / "my_cards.yaml"), "--limit", "2"], capfd
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "my_cards" in done.stdout
