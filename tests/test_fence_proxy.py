"""The forwarder that fences tensorstore's requests (control/fence_proxy.py), against a plain HTTP server on
loopback: requests framed by Content-Length and by chunks arrive whole with the real endpoint's Host, answers come
back, a keep-alive connection carries several requests; a request the fence refuses after its first MiB never
arrives whole. (A thawed holder's tensorstore through it, on the GCS emulator: tests/test_preemption.py.)"""
import http.client
import http.server
import threading

import pytest

from g2rl_jax.control import fence_proxy
from g2rl_jax.control.errors import LeaseLost


@pytest.fixture
def upstream():
    got = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 - http.server's name
            if self.headers.get("Transfer-Encoding") == "chunked":
                body = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    body += self.rfile.read(size)
                    self.rfile.readline()
                    if size == 0:
                        break
            else:
                length = int(self.headers["Content-Length"])
                body = self.rfile.read(length)
                if len(body) < length:
                    return  # cut off: nothing applied
            got.append((self.headers["Host"], self.path, body))
            answer = f"{len(body)}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", got
    server.shutdown()


def _client(forwarder) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(*forwarder.url.split("://", 1)[1].split(":"), timeout=30)


def test_requests_arrive_whole_with_the_real_host(upstream):
    url, got = upstream
    forwarder = fence_proxy.Forwarder(url)
    conn = _client(forwarder)
    big = bytes(range(256)) * (3 * 4096 + 7)  # 3 MiB and a bit: several pieces
    conn.request("POST", "/a?x=1", body=big)
    assert conn.getresponse().read() == str(len(big)).encode()
    conn.request("POST", "/b", body=iter([b"ab", b"", b"cde" * 1000]), encode_chunked=True)  # same connection
    assert conn.getresponse().read() == b"3002"
    conn.close()
    netloc = url.split("://", 1)[1]
    assert got == [(netloc, "/a?x=1", big), (netloc, "/b", b"ab" + b"cde" * 1000)]
    assert forwarder.refused == 0


def test_a_request_refused_mid_body_never_arrives_whole(upstream, monkeypatch):
    url, got = upstream
    forwarder = fence_proxy.Forwarder(url)
    checks = []

    def check_streams():  # the fence: held for the head and the first MiB, then the lease is lost
        checks.append(1)
        if len(checks) > 2:
            raise LeaseLost("run lock lost: taken over (test)")

    monkeypatch.setattr(fence_proxy.fence, "check_streams", check_streams)
    conn = _client(forwarder)
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        conn.request("POST", "/c", body=b"x" * (4 << 20))
        conn.getresponse().read()
    conn.close()
    assert got == [] and forwarder.refused == 1


def test_an_endpoint_it_cannot_reach_is_said_once(capfd):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    forwarder = fence_proxy.Forwarder(f"http://127.0.0.1:{port}")
    for _ in range(2):
        conn = _client(forwarder)
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            conn.request("POST", "/d", body=b"x")
            conn.getresponse().read()
        conn.close()
    lines = [line for line in capfd.readouterr().err.splitlines() if "cannot reach" in line]
    assert len(lines) == 1 and f"127.0.0.1:{port}: ConnectionRefusedError" in lines[0], lines


@pytest.mark.parametrize("given, want", [("http://127.0.0.1:1", "http://127.0.0.1:9"),  # the starter's forwarder
                                         ("http://127.0.0.1:5", "http://127.0.0.1:5")])  # an endpoint it chose
def test_a_started_process_gets_the_endpoint_back_unless_its_starter_chose_one(given, want):
    """A process started by one whose tensorstore goes through its forwarder inherits the variable pointing at that
    forwarder: its storage setup puts back the endpoint the starter had before; an endpoint the starter set for it
    (a test's dead server, a second emulator) is kept."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TENSORSTORE_GCS_HTTP_URL=given, G2RL_JAX_TENSORSTORE_FORWARDER="http://127.0.0.1:1",
               G2RL_JAX_TENSORSTORE_UPSTREAM="http://127.0.0.1:9")
    code = ("import os; from g2rl_jax.control import fence_proxy as f; f.inherited(); "
            "print(os.environ.get(f.TS_URL_ENV), f.FORWARDER_ENV in os.environ, f.UPSTREAM_ENV in os.environ)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [want, "False", "False"]
