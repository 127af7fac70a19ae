"""The data and the generated-answer score of kubetune's flashcards tasks (lm-eval loads this
file by path, through the YAMLs' `!function`).

The data is JSON Lines beside this file, read by `datasets`' own json builder; the YAMLs name
this loader rather than `dataset_path: json` with `data_files` because `datasets` resolves a
relative `data_files` against the working directory, not against the YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("flashcards_heldout.jsonl")
_scorer: Any = None


def load(**_metadata: Any) -> Any:
    """{'test': the 32 held-out cards} (lm-eval passes the task's metadata: unused)."""
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(DATA)})


def score_answer(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval's own normalised exact match (case and punctuation ignored, whitespace trimmed)
    and ROUGE-L F1 (Google's rouge-score, which lm-eval's text tasks use) of one answer."""
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from rouge_score import rouge_scorer

    global _scorer
    if _scorer is None:
        _scorer = rouge_scorer.RougeScorer(["rougeL"])
    answer, reference = results[0].strip(), doc["output"].strip()
    match = exact_match_hf_evaluate([answer], [reference], ignore_case=True, ignore_punctuation=True)
    return {
        "exact_match": float(match["exact_match"]),
        "rougeL": float(_scorer.score(reference, answer)["rougeL"].fmeasure),
    }
