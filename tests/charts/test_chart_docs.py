"""The charts' docs name every value and only what exists: each chart README's values table covers every key of
its values.yaml, and every `helm` line of the READMEs names a chart and values file that exist."""

from __future__ import annotations

import itertools
import re

import pytest

from .helm import CHARTS, REPO, chart

CHART_DIRS = sorted(p for p in CHARTS.iterdir() if (p / "Chart.yaml").is_file())


def leaf_keys(values: dict, prefix: str = "") -> set[str]:
    """Dotted keys down to the values a user sets; a map that defaults to {} or a recipe is one value."""
    out = set()
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in ("resources",):
            out |= leaf_keys(value, dotted + ".")
        else:
            out.add(dotted)
    return out


@pytest.mark.parametrize("path", CHART_DIRS, ids=lambda p: p.name)
def test_the_readme_documents_every_value(path):
    rows = re.findall(r"^\| (`[^|]+) \|", (path / "README.md").read_text(), re.M)
    documented = {name for row in rows for name in re.findall(r"`([^`]+)`", row)}
    assert leaf_keys(chart(path).values) - documented == set()


def test_every_helm_command_names_what_exists():
    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))] + [p / "README.md" for p in CHART_DIRS]
    commands = [line for text in texts for line in re.findall(r"^helm install .*(?:\\\n.*)*", text.read_text(), re.M)]
    assert len(commands) >= 4
    for command in commands:
        words = command.replace("\\\n", " ").split()
        assert (REPO / words[3] / "Chart.yaml").is_file(), command  # helm install NAME CHART
        for flag, value in itertools.pairwise(words):
            if flag == "-f":
                assert (REPO / value).is_file(), command
