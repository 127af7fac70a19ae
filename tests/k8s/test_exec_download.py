"""`kubetune k8s download` through the real client: exec over a websocket, tar on stdout.

kmock does not emulate exec, so this test serves the few endpoints download uses from a
small aiohttp app on loopback: GET of the data pod and the recipe ConfigMap, and the pod's
`exec` websocket speaking the v4.channel.k8s.io protocol (channel byte + payload; channel 3
carries the exit status).
"""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
import threading

import pytest

JOB, NS = "run", "kubetune"
WEIGHTS = bytes(range(256)) * 4096  # 1 MiB of every byte value: must arrive unchanged


def _tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in ((f"{JOB}/adapter/adapter_model.safetensors", WEIGHTS), (f"{JOB}/summary.json", b"{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def api(tmp_path, monkeypatch):
    from aiohttp import web  # aiohttp comes with kmock

    seen: dict = {"commands": [], "auth": []}

    async def data_pod(request):
        return web.json_response(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{JOB}-data"}, "status": {"phase": "Running"}}
        )

    async def recipe(request):
        return web.json_response(
            {"apiVersion": "v1", "kind": "ConfigMap", "data": {"recipe.yaml": f"output_dir: /data/runs/{JOB}\n"}}
        )

    async def exec_(request):
        command = request.query.getall("command")
        seen["commands"].append(command)
        seen["auth"].append(request.headers.get("Authorization"))
        ws = web.WebSocketResponse(protocols=("v4.channel.k8s.io",))
        await ws.prepare(request)
        if command[:2] == ["tar", "cf"]:
            payload = _tar()
            for i in range(0, len(payload), 65536):  # many frames, like a real stream
                await ws.send_bytes(b"\x01" + payload[i : i + 65536])
            await ws.send_bytes(b"\x03" + json.dumps({"metadata": {}, "status": "Success"}).encode())
        else:
            await ws.send_bytes(b"\x02" + b"tail: cannot open '/x': No such file or directory\n")
            await ws.send_bytes(
                b"\x03"
                + json.dumps(
                    {
                        "status": "Failure",
                        "reason": "NonZeroExitCode",
                        "details": {"causes": [{"reason": "ExitCode", "message": "1"}]},
                    }
                ).encode()
            )
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_get(f"/api/v1/namespaces/{NS}/pods/{JOB}-data", data_pod)
    app.router.add_get(f"/api/v1/namespaces/{NS}/configmaps/{JOB}-recipe", recipe)
    app.router.add_get(f"/api/v1/namespaces/{NS}/pods/{JOB}-data/exec", exec_)
    ready, stop, state = threading.Event(), threading.Event(), {}

    async def serve():
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state["port"] = site._server.sockets[0].getsockname()[1]
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.02)
        await runner.cleanup()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(10)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "t",
                "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{state['port']}"}}],
                "users": [{"name": "u", "user": {"token": "tok-123"}}],
                "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u"}}],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield seen
    stop.set()
    thread.join(5)


def test_download_streams_binary_files_through_exec(cli, api, tmp_path):
    result = cli("k8s", "download", JOB, "-n", NS, "-o", str(tmp_path / "out"))
    assert result.code == 0, result.err
    assert result.out.strip() == str(tmp_path / "out" / JOB)
    assert (tmp_path / "out" / JOB / "adapter" / "adapter_model.safetensors").read_bytes() == WEIGHTS
    assert api["commands"] == [["tar", "cf", "-", "-C", "/data/runs", JOB]]
    assert api["auth"] == ["Bearer tok-123"]  # the kubeconfig's credentials reach the websocket


def test_a_failing_command_is_one_line_with_its_stderr(api):
    from kubetune.kubeapi import ClusterError, connect

    with pytest.raises(ClusterError) as err:
        connect().exec_to(f"{JOB}-data", NS, ["tail", "/x"], io.BytesIO(), container="data")
    assert str(err.value) == "`tail /x` in pod run-data exited 1: tail: cannot open '/x': No such file or directory"
