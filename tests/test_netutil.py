"""kubetune.netutil: a free port, and waiting for a server that may never come up."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kubetune.netutil import NotReadyError, free_port, http_answers, http_ok, tcp_accepts, wait_ready


@contextmanager
def answering(status: int) -> Iterator[str]:
    """A loopback HTTP server that answers every GET with `status`; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_free_port_can_be_listened_on():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert tcp_accepts("127.0.0.1", port)


def test_nothing_answers_on_a_free_port():
    port = free_port()
    assert not tcp_accepts("127.0.0.1", port)
    assert not http_ok(f"http://127.0.0.1:{port}/ready")
    assert not http_answers(f"http://127.0.0.1:{port}/ready")


def test_ready_means_200_and_answering_means_any_status():
    with answering(503) as url:
        assert not http_ok(url + "/ready") and http_answers(url + "/healthz")
        with pytest.raises(NotReadyError, match=r"/ready not ready in 0\.3 s"):
            wait_ready(url + "/ready", 0.3)
    with answering(200) as url:
        wait_ready(url + "/ready", 5)


def test_a_check_that_never_holds_times_out_under_its_name():
    with pytest.raises(NotReadyError, match=r"the thing not ready in 0\.2 s"):
        wait_ready(lambda: False, 0.2, name="the thing")


@pytest.mark.process
def test_a_process_that_dies_fails_fast_with_its_code_and_output(tmp_path):
    script = "import sys; print('cannot bind: address in use'); sys.exit(3)"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    with pytest.raises(NotReadyError, match=r"exited with code 3 .*cannot bind: address in use"):
        wait_ready(f"http://127.0.0.1:{free_port()}/ready", 60, process=proc)
    log = tmp_path / "server.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=sink)
    with pytest.raises(NotReadyError, match=r"exited with code 3 .*cannot bind"):
        wait_ready(lambda: False, 60, process=proc, log=log)
