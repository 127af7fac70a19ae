"""The monitoring page (docs/monitoring.md) is generated where it can be (the tables) and says what the
code does (the release label and its fix, the commands)."""

from __future__ import annotations

from pathlib import Path

from kubetune.contracts.metrics import DEFAULT_RELEASE, DEFAULT_TRAIN_PORT
from kubetune.monitor.reference import alerts_markdown, dashboards_markdown, training_metrics_markdown

SECTION = (Path(__file__).resolve().parents[2] / "docs" / "monitoring.md").read_text()


def test_the_tables_are_the_generated_ones():
    for table in (training_metrics_markdown(), alerts_markdown(), dashboards_markdown()):
        assert table in SECTION, (
            "regenerate docs/monitoring.md's tables from kubetune.monitor.reference "
            f"(training_metrics_markdown, alerts_markdown, dashboards_markdown):\n{table}"
        )


def test_the_release_label_warning_names_the_fix():
    assert f"release: {DEFAULT_RELEASE}" in SECTION and "monitor.release=" in SECTION
    assert "kubectl label podmonitor NAME -n NAMESPACE release=RELEASE --overwrite" in SECTION
    assert str(DEFAULT_TRAIN_PORT) in SECTION


def test_the_commands_shown_exist():
    from typer.main import get_command

    from kubetune.cli import app

    monitor = get_command(app).commands["monitor"]
    assert set(monitor.commands) == {"render", "check"}
    flags = {f for c in monitor.commands.values() for p in c.params for f in p.opts}
    for flag in ("-o", "--recipe", "--prometheus", "--job", "--objects", "--release", "-n"):
        assert flag in flags and flag in SECTION, flag
