"""One grammar over every `kubetune` command, hidden ones included: `--help` works, `-o` is an
output path, `-n` the one namespace the command acts in, and no help text names a seed (users
never read the seeds: a text names the setting and what it does)."""

from __future__ import annotations

import importlib.metadata
import itertools
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

import kubetune
from kubetune.cli import OLD_POD_SPELLINGS, app

README = Path(__file__).resolve().parents[1] / "README.md"

# typer vendors its own click (its options carry the declared annotation, not a click type): duck-typed
Command = Any


def _walk(command: Command, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Command]]:
    found = [(path, command)]
    for name, sub in getattr(command, "commands", {}).items():
        found += _walk(sub, (*path, name))
    return found


COMMANDS = _walk(typer.main.get_command(app), ())
IDS = [" ".join(path) or "kubetune" for path, _ in COMMANDS]


def _options(command: Command) -> list[Any]:
    return [p for p in command.params if p.param_type_name == "option"]


def _annotation(option: Any) -> Any:
    return option.type_descriptor.annotation


def _short_form_problems(option: Any) -> list[str]:
    opts = [*option.opts, *option.secondary_opts]
    if "-o" in opts and not ({"--output", "--out"} & set(opts) and _annotation(option) is Path):
        return [f"-o ({'/'.join(opts)}): not an output path"]
    single = not (option.multiple or option.is_flag or option.nargs != 1)
    says_namespace = "namespace" in (option.help or "namespace").lower()  # an option without help: its name says
    if "-n" in opts and not ("--namespace" in opts and single and says_namespace):
        return [f"-n ({'/'.join(opts)}): not the one namespace the command acts in"]
    return []


def _texts(command: Command) -> list[str]:
    texts = [command.help or "", command.short_help or ""]
    return texts + [getattr(p, "help", None) or "" for p in command.params]


def test_the_walk_reaches_every_group_and_the_hidden_pod_commands():
    ids = set(IDS)
    assert {"k8s render", "monitor check", "operator crd", "recipe show", "data make-preferences"} <= ids
    assert {"pod operator", "pod device-plugin", "pod netprobe", "k8s render-components"} <= ids
    # the spellings of manifests applied before the pod group: still there, out of --help
    top = typer.main.get_command(app).commands
    assert all(top[name].hidden for name in OLD_POD_SPELLINGS) and top["pod"].hidden
    assert "pod" not in CliRunner().invoke(app, ["--help"]).output.split()


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=IDS)
def test_every_command_keeps_the_grammar(path, command):
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    problems = [p for option in _options(command) for p in _short_form_problems(option)]
    problems += [f"help names a seed: {text!r}" for text in _texts(command) if "seed 0" in text.lower()]
    assert not problems, "\n".join(problems)


def _option(*opts: str, annotation: type = str, multiple: bool = False, help: str = "") -> Any:
    typed = SimpleNamespace(annotation=annotation)
    return SimpleNamespace(
        opts=list(opts), secondary_opts=[], type_descriptor=typed, multiple=multiple, is_flag=False, nargs=1, help=help
    )


def test_the_grammar_check_catches_what_it_forbids():
    # each rule fails on the flag it was written against, so the walk above cannot pass vacuously
    watch = _option("--namespace", "-n", multiple=True, help="Watch this namespace (repeatable).")
    output_format = _option("--output", "-o", help="Output format: yaml or json.")
    assert _short_form_problems(watch) and _short_form_problems(output_format)
    assert _short_form_problems(_option("-n", "--namespace", help="How many nodes."))
    assert not _short_form_problems(_option("-n", "--namespace", help="Namespace of the job."))
    assert not _short_form_problems(_option("-o", "--output", annotation=Path, help="Write here."))


def test_the_walk_reads_the_options_of_real_commands():
    # the options of a real command: a walk that read none would check nothing
    (output,) = [o for o in _options(typer.main.get_command(app).commands["export"]) if "-o" in o.opts]
    assert _annotation(output) is Path and not _short_form_problems(output)


def test_version_prints_the_packages_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"kubetune {kubetune.__version__}\n"
    assert kubetune.__version__ == importlib.metadata.version("kubetune")


def _table_commands(readme: str) -> list[tuple[str, ...]]:
    """The command paths of README's command table: `kubetune recipe show\\|list ...` -> (recipe, show),
    (recipe, list)."""
    table = readme.split("## Commands", 1)[1].split("\n## ", 1)[0]
    paths = []
    for code in re.findall(r"^\| `kubetune ([^`]*)`", table, flags=re.MULTILINE):
        words = list(
            itertools.takewhile(lambda w: re.fullmatch(r"[a-z][a-z0-9-]*(\\\|[a-z][a-z0-9-]*)*", w), code.split())
        )
        paths += itertools.product(*(w.split("\\|") for w in words))
    return paths


def test_the_readme_table_lists_every_command_once():
    leaves = [path for path, command in COMMANDS if not hasattr(command, "commands")]
    expected = Counter(path for path in leaves if not (len(path) == 1 and path[0] in OLD_POD_SPELLINGS))
    listed = Counter(_table_commands(README.read_text()))
    twice = [path for path, n in listed.items() if n > 1]
    assert listed == expected, f"twice: {twice}; missing: {expected - listed}; not a command: {listed - expected}"
    # the parse itself: a command written twice, or one left out, is seen
    assert _table_commands("## Commands\n| `kubetune a b\\|c X` | . |\n| `kubetune a b` | . |\n") == [
        ("a", "b"),
        ("a", "c"),
        ("a", "b"),
    ]
