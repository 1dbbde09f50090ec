"""A loopback proxy in front of a GCS server (fake-gcs-server, gcs_emulator.py) that behaves as GCS may and the
emulator does not:

- one update per second per object: a second update (upload, compose, copy or rewrite onto it, metadata patch,
  delete) of one object name within `update_interval` seconds of the last successful one is answered 429 Too Many
  Requests, with GCS's JSON error body, and counted;
- preconditions as GCS keeps them: a compose (which the emulator applies without its ifGenerationMatch and without
  giving the object a new generation) is served as GCS serves it: the sources read and their concatenation uploaded
  with the compose's precondition (a new generation; 412 when the destination changed); a delete with
  ifGenerationMatch (which the emulator ignores) is checked first; each under a lock of the object, so no other
  request through the proxy comes between the check and the change;
- faults (gcs_faults.py): seeded rates per request and rules added while it runs, before forwarding (503, 429, a
  dropped connection, a slow answer) or after the server applied the request (a late answer, the answer dropped, a
  503 instead of it); `after_apply` for the next updates of one object.

    with GcsProxy(upstream="http://127.0.0.1:PORT", faults=Faults(rate_503=0.01, seed=0)) as proxy:
        ... clients pointed at proxy.endpoint ...
        proxy.plan.add(Rule("lost", kinds=UPDATES, rate=0.3), seconds=20)   # replies dropped after apply, 20 s
    proxy.served_429, proxy.fault_counts, proxy.requests   # what it served
    proxy.log                                             # one Request per request: kind, object, bytes, status,
                                                          # fault (with who=f each update's client pid, f(pid))

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
import socket
import threading
import time
import urllib.parse
from collections import Counter

from g2rl_jax.bench.gcs_faults import STRICT, FaultPlan, Faults, Rule  # noqa: F401 - the proxy's interface
from g2rl_jax.storage_clients import UPDATES, classify

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "te", "trailer",
              "upgrade"}


@dataclasses.dataclass
class Request:
    method: str
    kind: str          # storage_clients.classify's: "upload", "compose", "delete", "read", "list", ...
    obj: str | None    # "bucket/name" of the object it reads or updates, when it names one
    bytes_in: int      # request body
    bytes_out: int     # response body
    status: int        # the server's answer when forwarded, else what the client got (429, 503, 0: dropped)
    t: float = 0.0     # when it arrived (time.monotonic())
    pid: int | None = None  # the client's process: for the 429s it was served, and with `who` for every update
    who: object = None  # with `who`: what who(pid) named the client of an update
    fault: str | None = None  # the fault served (gcs_faults.py), None for none
    done: float = 0.0  # when the server's answer came (time.monotonic()); 0 when it was not forwarded


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
    def __init__(self, upstream: str, *, faults: Faults | None = None, update_interval: float = 1.0, port: int = 0,
                 who=None):
        """who: a function of a client's pid; every update is logged with its client's pid and who(pid)
        (Request.pid, Request.who), found once per connection (the chaos soak tells a fenced-out holder's writes by
        it)."""
        self.upstream = urllib.parse.urlsplit(upstream)
        self.update_interval, self.who = update_interval, who
        self.plan = FaultPlan(faults or Faults())
        self._lock = threading.Lock()
        self._last_update: dict[str, float] = {}
        self._object_locks: dict[str, threading.Lock] = {}
        self._uploads: dict[str, str] = {}  # resumable upload id -> object
        self._finished: dict[str, tuple[int, list, bytes]] = {}  # resumable upload id -> its final answer
        self.log: list[Request] = []
        self.fault_counts: Counter = Counter()
        self._server = _Server(("127.0.0.1", port), self._handler())
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._thread: threading.Thread | None = None

    @property
    def faults(self) -> Faults:
        """The seeded rates in force (the rules aside); set to serve others from now on."""
        return self.plan.faults

    @faults.setter
    def faults(self, faults: Faults) -> None:
        self.plan.faults = faults

    # -------------------------------------------------------------------------------------------- counts
    @property
    def served_429(self) -> int:
        """429s served by the one-update-a-second rule (not by a 429 fault)."""
        return sum(r.status == 429 and r.fault is None for r in self.log)

    @property
    def requests(self) -> int:
        return len(self.log)

    def throttled(self) -> Counter:
        """Object -> 429s the one-update-a-second rule served for it."""
        return Counter(r.obj for r in self.log if r.status == 429 and r.fault is None)

    def after_apply(self, obj: str, *, delay_s: float = 0.0, drop: bool = False, count: int = 1) -> Rule:
        """The next `count` updates of object `obj` ("bucket/name") are forwarded (the server applies them), then
        their reply is held `delay_s` seconds (fault "late"), or with `drop` never sent (fault "lost")."""
        return self.plan.add(Rule("lost" if drop else "late", kinds=UPDATES, obj=obj, count=count, seconds=delay_s))

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

    def _object_lock(self, obj: str) -> threading.Lock:
        with self._lock:
            return self._object_locks.setdefault(obj, threading.Lock())

    def _record(self, request: Request) -> None:
        with self._lock:
            self.log.append(request)
            if request.fault:
                self.fault_counts[request.fault] += 1

    def _handler(self):
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            _conn: http.client.HTTPConnection | None = None
            _pid: int | None = None
            _who: object = None

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

            def _answer(self, request, status: int, message: str, *, record: bool = True) -> None:
                """Answer `status` with GCS's JSON error body; the request is logged before the reply goes out, so a
                client that has its answer finds it counted."""
                body = _error_body(status, message)
                if record:
                    request.status, request.bytes_out = status, len(body)
                    if status == 429 and request.pid is None:  # who drew it: the client end of this connection
                        request.pid = client_pid(self.client_address[1])
                    proxy._record(request)
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _upstream(self, method: str, path: str, body: bytes, headers: dict) -> tuple[int, list, bytes]:
                headers = {**headers, "Content-Length": str(len(body))}
                for attempt in range(2):  # a kept-alive upstream connection may have been closed meanwhile
                    if self._conn is None:
                        self._conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port,
                                                                timeout=600)
                    try:
                        self._conn.request(method, path, body=body, headers=headers)
                        response = self._conn.getresponse()
                        return response.status, response.getheaders(), response.read()
                    except (http.client.HTTPException, OSError):
                        self._conn.close()
                        self._conn = None
                        if attempt:
                            raise
                raise AssertionError("unreachable")

            def _forward(self, kind: str, obj: str | None, query: dict, body: bytes) -> tuple[int, list, bytes]:
                if kind == "compose" and obj is not None:
                    with proxy._object_lock(obj):
                        return self._compose(obj, query, body)
                if kind == "delete" and obj is not None and "ifGenerationMatch" in query:
                    with proxy._object_lock(obj):
                        return self._conditional_delete(obj, query["ifGenerationMatch"])
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"expect"}}
                upload_id = query.get("upload_id") if kind == "upload" else None
                if upload_id is not None and upload_id in proxy._finished:  # GCS answers a finished session's
                    return proxy._finished[upload_id]  # retry with the object (the emulator: 404)
                answer = self._upstream(self.command, self.path, body, headers)
                if upload_id is not None and answer[0] in (200, 201):
                    with proxy._lock:
                        proxy._finished[upload_id] = answer
                return answer

            def _compose(self, obj: str, query: dict, body: bytes) -> tuple[int, list, bytes]:
                """A compose as GCS serves it: the sources' bytes uploaded onto the destination with the compose's
                ifGenerationMatch (the emulator's own compose ignores it and keeps the generation)."""
                bucket, name = obj.split("/", 1)
                request = json.loads(body or b"{}")
                parts = []
                for source in request.get("sourceObjects", []):
                    status, headers, data = self._upstream(
                        "GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(source['name'], safe='')}?alt=media",
                        b"", {})
                    if status != 200:
                        return status, headers, data
                    parts.append(data)
                params = {"uploadType": "multipart"}  # the emulator keeps preconditions on multipart uploads only
                params |= {k: query[k] for k in ("ifGenerationMatch",) if k in query}
                content_type = (request.get("destination") or {}).get("contentType") or "application/octet-stream"
                upload = (f"--==0==\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                          f"{json.dumps({'name': name, 'contentType': content_type})}\r\n--==0==\r\n"
                          f"Content-Type: {content_type}\r\n\r\n").encode() + b"".join(parts) + b"\r\n--==0==--"
                return self._upstream("POST", f"/upload/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(params)}",
                                      upload, {"Content-Type": 'multipart/related; boundary="==0=="'})

            def _conditional_delete(self, obj: str, expected: str) -> tuple[int, list, bytes]:
                bucket, name = obj.split("/", 1)
                path = f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}"
                status, headers, data = self._upstream("GET", path, b"", {})
                if status == 200 and str(json.loads(data).get("generation")) != str(expected):
                    return 412, [("Content-Type", "application/json; charset=UTF-8")], _error_body(
                        412, "At least one of the pre-conditions you specified did not hold.")
                if status != 200:
                    return status, headers, data
                return self._upstream("DELETE", path, b"", {})

            def _serve(self):
                body = self._body()
                split = urllib.parse.urlsplit(self.path)
                query = {k: v[0] for k, v in urllib.parse.parse_qs(split.query).items()}
                kind, obj = classify(self.command, split.path, query, body, proxy._uploads)
                request = Request(self.command, kind, obj, len(body), 0, 0, time.monotonic())
                if proxy.who is not None and kind in (*UPDATES, "start"):
                    if self._pid is None:  # once per connection (a client keeps its connections alive)
                        self._pid = client_pid(self.client_address[1])
                        self._who = proxy.who(self._pid)
                    request.pid, request.who = self._pid, self._who
                fault, seconds = proxy.plan.draw(kind, obj)
                request.fault = fault
                if fault == "drop":
                    self._drop(request)
                    return
                if fault in ("503", "429"):
                    what = "Service Unavailable" if fault == "503" else "Too Many Requests"
                    self._answer(request, int(fault), f"{what} (injected)")
                    return
                if fault == "slow":
                    time.sleep(seconds)
                allowed, previous = proxy._admit(kind, obj)
                if not allowed:
                    request.fault = None  # the rate rule's own 429
                    self._answer(request, 429, f"The object {obj} exceeded the rate limit for object mutation "
                                               "operations (create, update, and delete).")
                    return
                status, headers, data = self._forward(kind, obj, query, body)
                request.done = time.monotonic()
                if kind in UPDATES and obj is not None:
                    proxy._settle(obj, previous, status)
                for name, value in headers:
                    if name.lower() == "location" and "upload_id=" in value and obj is not None:
                        upload_id = urllib.parse.parse_qs(urllib.parse.urlsplit(value).query)["upload_id"][0]
                        with proxy._lock:
                            proxy._uploads[upload_id] = obj
                request.status, request.bytes_out = status, len(data)
                if fault == "lost":  # applied; the client never hears of it
                    self._drop(request)
                    return
                if fault == "lost503":
                    proxy._record(request)
                    self._answer(request, 503, "Service Unavailable (injected, after the request was applied)",
                                 record=False)
                    return
                proxy._record(request)  # before the reply, as _answer
                if fault == "late":
                    time.sleep(seconds)
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in HOP_BY_HOP:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _drop(self, request: Request) -> None:
                proxy._record(request)
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _serve

        return Handler


def _error_body(status: int, message: str) -> bytes:
    """GCS's JSON error body."""
    reason = {429: "rateLimitExceeded", 412: "conditionNotMet"}.get(status, "backendError")
    return json.dumps({"error": {"code": status, "message": message,
                                 "errors": [{"message": message, "reason": reason}]}}).encode()
