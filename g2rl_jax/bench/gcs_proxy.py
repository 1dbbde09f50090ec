"""A loopback proxy in front of a GCS server (fake-gcs-server, gcs_emulator.py) that behaves as GCS may and the
emulator does not:

- one update per second per object: a second update (upload, compose, copy or rewrite onto it, metadata patch,
  delete) of one object name within `update_interval` seconds of the last successful one is answered 429 Too Many
  Requests, with GCS's JSON error body, and counted;
- faults at a seeded rate, each drawn per request before it is forwarded (so the server never applied it and a
  client's retry is safe): a 503 Service Unavailable, a slow answer (`slow_s` seconds late), or a dropped connection
  (closed with no answer);
- targeted faults after the server applied an update (`after_apply`): its reply held back, or never sent.

    with GcsProxy(upstream="http://127.0.0.1:PORT", faults=Faults(rate_503=0.01, seed=0)) as proxy:
        ... clients pointed at proxy.endpoint ...
    proxy.served_429, proxy.faults, proxy.requests       # what it served
    proxy.log                                             # one Request per request: kind, object, bytes, status
                                                          # (and for a 429, the pid of the client it went to)

It counts every request (method, object, bytes each way), so a benchmark can say what each file costs
(g2rl_jax/bench/storage.py). Used by `GcsEmulator(proxy=...)`, which starts the server with this proxy's address as
its external URL (resumable-upload locations then point at the proxy too). Plain HTTP/1.1 with keep-alive, as gcsfs
(aiohttp) and tensorstore (libcurl) speak to an emulator.
"""
from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import random
import socket
import threading
import time
import urllib.parse
from collections import Counter

from g2rl_jax.storage_clients import UPDATES, classify

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te", "trailer",
              "upgrade"}


@dataclasses.dataclass(frozen=True)
class Faults:
    """Seeded fault rates, each a probability per request."""

    rate_503: float = 0.0
    rate_slow: float = 0.0
    rate_drop: float = 0.0
    slow_s: float = 0.5
    seed: int = 0


STRICT = Faults(rate_503=0.003, rate_slow=0.005, rate_drop=0.002, slow_s=0.3, seed=0)  # what the tests serve


@dataclasses.dataclass
class Request:
    method: str
    kind: str          # storage_clients.classify's: "upload", "compose", "delete", "read", "list", ...
    obj: str | None    # "bucket/name" of the object it reads or updates, when it names one
    bytes_in: int      # request body
    bytes_out: int     # response body
    status: int        # what the client got (429, 503, 0 for a dropped connection, else the server's)
    t: float = 0.0     # when it arrived (time.monotonic())
    pid: int | None = None  # the client's process, for the 429s it was served (Linux: from /proc; else None)


def client_pid(port: int) -> int | None:
    """The pid of the local process whose TCP socket has local port `port` (the client end of a connection to this
    proxy), from /proc/net/tcp and the processes' open file descriptors; None if not found (or not Linux)."""
    import os

    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    def link(fd_path: str) -> str:
        try:
            return os.readlink(fd_path)
        except OSError:  # closed meanwhile
            return ""

    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()) if inodes else ():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to look into
            continue
        if any(link(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
            return pid
    return None




class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        """A client that closed its connection (a killed trainer, a client's own timeout) is no error here."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class GcsProxy:
    def __init__(self, upstream: str, *, faults: Faults = Faults(), update_interval: float = 1.0, port: int = 0):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.faults, self.update_interval = faults, update_interval
        self._rng = random.Random(faults.seed)
        self._lock = threading.Lock()
        self._last_update: dict[str, float] = {}
        self._uploads: dict[str, str] = {}  # resumable upload id -> object
        self.log: list[Request] = []
        self.fault_counts: Counter = Counter()
        self._after_apply: list[list] = []  # [object suffix, requests left, reply delay, drop]: after_apply
        self._server = _Server(("127.0.0.1", port), self._handler())
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------------------------------------- counts
    @property
    def served_429(self) -> int:
        return sum(r.status == 429 for r in self.log)

    @property
    def requests(self) -> int:
        return len(self.log)

    def throttled(self) -> Counter:
        """Object -> 429s served for it."""
        return Counter(r.obj for r in self.log if r.status == 429)

    def after_apply(self, suffix: str, *, delay_s: float = 0.0, drop: bool = False, count: int = 1) -> None:
        """The next `count` updates of an object whose name ends with `suffix` are forwarded (the server applies
        them), then their reply is held `delay_s` seconds, and with `drop` never sent (the connection is closed):
        a reply delayed or lost after the store applied the request (each counted as fault "late" or "lost")."""
        with self._lock:
            self._after_apply.append([suffix, count, delay_s, drop])

    def _applied_fault(self, kind: str, obj: str | None) -> tuple[float, bool] | None:
        if kind not in UPDATES or obj is None:
            return None
        with self._lock:
            for fault in self._after_apply:
                if fault[1] > 0 and obj.endswith(fault[0]):
                    fault[1] -= 1
                    self.fault_counts["lost" if fault[3] else "late"] += 1
                    return fault[2], fault[3]
        return None

    def reset(self) -> None:
        with self._lock:
            self.log.clear()
            self.fault_counts.clear()

    # -------------------------------------------------------------------------------------------- serving
    def start(self) -> GcsProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="gcs-proxy")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> GcsProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _draw(self) -> str | None:
        f = self.faults
        with self._lock:
            u = self._rng.random()
        for name, rate in (("503", f.rate_503), ("drop", f.rate_drop), ("slow", f.rate_slow)):
            if u < rate:
                return name
            u -= rate
        return None

    def _admit(self, kind: str, obj: str | None) -> tuple[bool, float | None]:
        """(allowed, the object's previous update time) for an update; a read is always allowed."""
        if kind not in UPDATES or obj is None:
            return True, None
        now = time.monotonic()
        with self._lock:
            last = self._last_update.get(obj)
            if last is not None and now - last < self.update_interval:
                return False, last
            self._last_update[obj] = now  # taken now: a concurrent second update is refused too
            return True, last

    def _settle(self, obj: str, previous: float | None, status: int) -> None:
        """A refused update (4xx/5xx) did not change the object: its slot goes back."""
        if status >= 300:
            with self._lock:
                if previous is None:
                    self._last_update.pop(obj, None)
                else:
                    self._last_update[obj] = previous

    def _record(self, request: Request) -> None:
        with self._lock:
            self.log.append(request)

    def _handler(self):
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            _conn: http.client.HTTPConnection | None = None

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if not size:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _answer(self, request, status: int, message: str) -> None:
                """Answer `status` with GCS's JSON error body; the request is logged before the reply goes out, so a
                client that has its answer finds it counted."""
                body = json.dumps({"error": {"code": status, "message": message,
                                             "errors": [{"message": message, "reason": "rateLimitExceeded"
                                                         if status == 429 else "backendError"}]}}).encode()
                request.status, request.bytes_out = status, len(body)
                if status == 429:  # who drew it: the client end of this connection
                    request.pid = client_pid(self.client_address[1])
                proxy._record(request)
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _forward(self, body: bytes) -> tuple[int, list, bytes]:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"expect"}}
                headers["Content-Length"] = str(len(body))
                for attempt in range(2):  # a kept-alive upstream connection may have been closed meanwhile
                    if self._conn is None:
                        self._conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port,
                                                                timeout=600)
                    try:
                        self._conn.request(self.command, self.path, body=body, headers=headers)
                        response = self._conn.getresponse()
                        return response.status, response.getheaders(), response.read()
                    except (http.client.HTTPException, OSError):
                        self._conn.close()
                        self._conn = None
                        if attempt:
                            raise
                raise AssertionError("unreachable")

            def _serve(self):
                body = self._body()
                split = urllib.parse.urlsplit(self.path)
                query = {k: v[0] for k, v in urllib.parse.parse_qs(split.query).items()}
                kind, obj = classify(self.command, split.path, query, body, proxy._uploads)
                request = Request(self.command, kind, obj, len(body), 0, 0, time.monotonic())
                fault = proxy._draw()
                if fault:
                    with proxy._lock:
                        proxy.fault_counts[fault] += 1
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    proxy._record(request)
                    return
                if fault == "503":
                    self._answer(request, 503, "Service Unavailable (injected)")
                    return
                if fault == "slow":
                    time.sleep(proxy.faults.slow_s)
                allowed, previous = proxy._admit(kind, obj)
                if not allowed:
                    self._answer(request, 429, f"The object {obj} exceeded the rate limit for object mutation "
                                               "operations (create, update, and delete).")
                    return
                status, headers, data = self._forward(body)
                if kind in UPDATES and obj is not None:
                    proxy._settle(obj, previous, status)
                applied = proxy._applied_fault(kind, obj)
                if applied is not None:
                    time.sleep(applied[0])
                    if applied[1]:  # applied by the server, its reply never sent
                        request.status, request.bytes_out = status, len(data)
                        proxy._record(request)
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                for name, value in headers:
                    if name.lower() == "location" and "upload_id=" in value and obj is not None:
                        upload_id = urllib.parse.parse_qs(urllib.parse.urlsplit(value).query)["upload_id"][0]
                        with proxy._lock:
                            proxy._uploads[upload_id] = obj
                request.status, request.bytes_out = status, len(data)
                proxy._record(request)  # before the reply, as _answer
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in HOP_BY_HOP:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _serve

        return Handler
