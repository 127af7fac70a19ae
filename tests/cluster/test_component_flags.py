"""`render-components`' flags are made from `ComponentSettings`, and each daemon's (`kubetune pod
device-plugin` ...) from its settings in `kubetune.cluster.settings`: each default is the field's,
and each flag's value reaches the field it names."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from typer.testing import CliRunner

from kubetune import __version__
from kubetune.cli import app
from kubetune.cluster import cli as cluster_cli
from kubetune.cluster import manifests, settings
from kubetune.cluster.deviceplugin import DEFAULT_PLUGIN_DIR, DEFAULT_POD_RESOURCES_SOCKET
from kubetune.cluster.dra import DEFAULT_CDI_DIR, DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR
from kubetune.cluster.extender import DEFAULT_PORT as EXTENDER_PORT
from kubetune.cluster.netprobe import DEFAULT_PORT as NETPROBE_PORT
from kubetune.flags import options_of, scalar_type


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


# The daemons: `kubetune pod <command>` takes the flags of its settings (kubetune.cluster.settings);
# a command checks them first, with its `_<name>_problems(s)`, which the tests below stop it at.
DAEMONS = {
    "device-plugin": ("_device_plugin_problems", settings.DevicePluginSettings),
    "dra-driver": ("_dra_problems", settings.DraDriverSettings),
    "scheduler-extender": ("_extender_problems", settings.ExtenderSettings),
    "netprobe": ("_netprobe_problems", settings.NetprobeSettings),
}


def _settings_received(monkeypatch, command: str, *flags: str):
    """The settings the command's body received from these flags (it stops at its checks)."""
    checks, _ = DAEMONS[command]
    received = []
    monkeypatch.setattr(cluster_cli, checks, lambda s: received.append(s) or ["stopped by the test"])
    monkeypatch.delenv("NODE_NAME", raising=False)
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    result = CliRunner().invoke(app, ["pod", command, *flags])
    assert str(result.exception) == "stopped by the test", result.output
    (s,) = received
    return s


def _given(default, kind):
    """A value unlike the default, and the words that give it after the flag."""
    if kind is tuple:
        return ("a=b", "c=d"), ["a=b", "c=d"]
    if kind in (int, float):
        return default + 3, [str(default + 3)]
    value = kind(f"{default}-given" if default else "given")
    return value, [str(value)]


def _every_flag(settings_class) -> tuple[list[str], dict]:
    argv, values = [], {}
    for f, option in options_of(settings_class):
        kind = scalar_type(settings_class, f)
        on, _, off = option.flag.partition("/")
        if kind is bool:
            assert f.default is False or off, f"{option.flag}: a switch on by default needs its --no- form"
            argv.append(off if f.default else on)
            values[f.name] = not f.default
            continue
        value, words = _given(f.default, kind)
        argv += [word for text in words for word in (on, text)]
        values[f.name] = value
    return argv, values


@pytest.mark.parametrize("command", sorted(DAEMONS))
def test_each_daemon_flag_reaches_its_settings_field(command, monkeypatch):
    _, settings_class = DAEMONS[command]
    argv, values = _every_flag(settings_class)
    assert set(values) == {f.name for f in dataclasses.fields(settings_class)}, "a field without a flag"
    assert _settings_received(monkeypatch, command, *argv) == settings_class(**values)


@pytest.mark.parametrize("command", sorted(DAEMONS))
def test_each_daemon_default_is_its_settings_default(command, monkeypatch):
    # the options' defaults are not restated: without flags the body gets the dataclass's defaults
    assert _settings_received(monkeypatch, command) == DAEMONS[command][1]()


def test_the_daemons_defaults_name_the_constants():
    plugin, dra_driver = settings.DevicePluginSettings(), settings.DraDriverSettings()
    assert plugin.plugin_dir == DEFAULT_PLUGIN_DIR and plugin.pod_resources_socket == DEFAULT_POD_RESOURCES_SOCKET
    assert (dra_driver.registry_dir, dra_driver.plugins_dir, dra_driver.cdi_dir) == (
        DEFAULT_REGISTRY_DIR,
        DEFAULT_PLUGINS_DIR,
        DEFAULT_CDI_DIR,
    )
    assert (settings.ExtenderSettings().port, settings.NetprobeSettings().port) == (EXTENDER_PORT, NETPROBE_PORT)
    # the selector the netprobe manifests pass is the prober's own default
    rendered = manifests.render(manifests.ComponentSettings())
    (daemonset,) = [
        o for o in rendered if o["kind"] == "DaemonSet" and o["metadata"]["name"] == manifests.NETPROBE_NAME
    ]
    args = daemonset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--selector") + 1] == settings.NetprobeSettings().selector
