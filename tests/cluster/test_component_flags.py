"""`render-components`' flags are made from `ComponentSettings`: each default is the field's, and
each flag's value reaches the field it names."""

from __future__ import annotations

import dataclasses

import yaml
from typer.testing import CliRunner

from kubetune import __version__
from kubetune.cli import app
from kubetune.cluster import manifests
from kubetune.cluster.extender import DEFAULT_PORT as EXTENDER_PORT
from kubetune.cluster.netprobe import DEFAULT_PORT as NETPROBE_PORT
from kubetune.flags import options_of


def _render(*flags: str) -> list[dict]:
    result = CliRunner().invoke(app, ["k8s", "render-components", *flags])
    assert result.exit_code == 0, result.output
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def test_without_flags_the_settings_defaults_are_rendered():
    assert _render() == manifests.render(manifests.ComponentSettings())


def test_every_settings_field_with_a_flag_is_an_option_of_the_command():
    text = CliRunner().invoke(app, ["k8s", "render-components", "--help"], env={"COLUMNS": "300"}).stdout
    assert [o.flag for _, o in options_of(manifests.ComponentSettings) if o.flag.split("/")[0] not in text] == []


def test_each_flag_reaches_its_field():
    given = manifests.ComponentSettings(
        namespace="ops", extender_port=9000, netprobe=False, node_selector=("a=b", "c=d"), watch_pods=False
    )
    flags = ["-n", "ops", "--extender-port", "9000", "--no-netprobe", "--node-selector", "a=b"]
    assert _render(*flags, "--node-selector", "c=d", "--stateless") == manifests.render(given)


def test_the_ports_and_the_image_are_named_once():
    defaults = manifests.ComponentSettings()
    assert (defaults.extender_port, defaults.netprobe_port) == (EXTENDER_PORT, NETPROBE_PORT)
    fields = {f.name: f for f in dataclasses.fields(manifests.ComponentSettings)}
    assert fields["image"].default == manifests.IMAGE and manifests.IMAGE.endswith(f":{__version__}")
