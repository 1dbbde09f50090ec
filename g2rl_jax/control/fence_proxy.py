"""Tensorstore's requests through the fence (control/fence.py): Orbax writes a checkpoint's arrays with tensorstore,
whose own HTTP client the paced gcsfs client's fence cannot see. Once a run directory on an object store is armed,
this process's tensorstore talks to a forwarder on loopback (`start` points TENSORSTORE_GCS_HTTP_URL at it), which
sends each request on to the real endpoint only while the run's lease is held: `fence.check_streams` before a
request's first byte and before each MiB of its body. A process frozen past its lease and thawed (its tensorstore
resumes at once, before its lease thread could decide) sends nothing more: the forwarder closes the connection
mid-request, so the store never sees a whole request and changes nothing; tensorstore's retries meet the same
refusal until the trainer stops with the lease's verdict.

The forwarder frames requests (header block, then a Content-Length or chunked body) only to check the fence between
them and to name the real endpoint's host in `Host`; answers are piped back unread. Towards Google Cloud Storage it
speaks TLS (tensorstore's plain HTTP stays on loopback), verified against Python's default trust store as gcsfs's
aiohttp is (SSL_CERT_FILE); towards an emulator, plain HTTP.

A process this one starts inherits the variable: its storage setup (`inherited`, from storage_clients.configure)
puts back the value this process was started with (kept in $G2RL_JAX_TENSORSTORE_UPSTREAM), unless the variable no
longer names this process's forwarder ($G2RL_JAX_TENSORSTORE_FORWARDER): the starter chose an endpoint for it.
"""
from __future__ import annotations

import asyncio
import os
import socket
import ssl
import sys
import threading
import urllib.parse

from g2rl_jax.control import fence
from g2rl_jax.control.errors import RunFailure

TS_URL_ENV = "TENSORSTORE_GCS_HTTP_URL"
UPSTREAM_ENV = "G2RL_JAX_TENSORSTORE_UPSTREAM"  # the value of TS_URL_ENV before `start` ("" when unset)
FORWARDER_ENV = "G2RL_JAX_TENSORSTORE_FORWARDER"  # the forwarder's URL `start` put there
GCS = "https://storage.googleapis.com"  # tensorstore's endpoint when TS_URL_ENV is unset
CHUNK = 1 << 20

_STARTED: dict[str, Forwarder] = {}  # upstream -> its forwarder
_START_LOCK = threading.Lock()


def start() -> str:
    """tensorstore pointed at a forwarder to its present endpoint (started once per endpoint); its loopback URL."""
    with _START_LOCK:
        current = os.environ.get(TS_URL_ENV, "")
        if any(f.url == current for f in _STARTED.values()):
            return current
        upstream = current or GCS
        if upstream not in _STARTED:
            _STARTED[upstream] = Forwarder(upstream)
        url = _STARTED[upstream].url
        os.environ.update({UPSTREAM_ENV: current, FORWARDER_ENV: url, TS_URL_ENV: url})
        return url


def inherited() -> None:
    """In a process started by one whose tensorstore went through its forwarder: the variable as it was before,
    unless the starter set it to another endpoint for this process."""
    forwarder = os.environ.get(FORWARDER_ENV)
    if forwarder is None or any(f.url == forwarder for f in _STARTED.values()):
        return
    before = os.environ.pop(UPSTREAM_ENV, "")
    del os.environ[FORWARDER_ENV]
    if os.environ.get(TS_URL_ENV) != forwarder:
        return
    if before:
        os.environ[TS_URL_ENV] = before
    else:
        os.environ.pop(TS_URL_ENV, None)


def refused() -> int:
    """Requests this process's forwarders cut off at the fence."""
    return sum(f.refused for f in _STARTED.values())


class Forwarder:
    """A loopback listener served by one event loop on a daemon thread: per connection, requests go out through the
    fence and answers come back as two tasks of that loop. (Not a thread per direction: an ssl socket read in one
    thread while written in another corrupts OpenSSL's state for the connection, and crashed the process in a loop
    of TLS requests; asyncio's TLS runs both directions on the one thread.)"""

    def __init__(self, upstream: str):
        parts = urllib.parse.urlsplit(upstream)
        self.tls = ssl.create_default_context() if parts.scheme == "https" else None
        self.host, self.port = parts.hostname, parts.port or (443 if self.tls else 80)
        self.netloc = parts.netloc.encode()
        self.refused, self.said = 0, set()
        listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        threading.Thread(target=self._run, args=(listener,), name="fence-proxy", daemon=True).start()

    def _run(self, listener: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(asyncio.start_server(self._serve, sock=listener, limit=2 * CHUNK))
        loop.run_forever()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = await asyncio.to_thread(socket.create_connection, (self.host, self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return await asyncio.open_connection(sock=sock, ssl=self.tls, server_hostname=self.host if self.tls else None,
                                             limit=2 * CHUNK)

    async def _connect_or_say(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """`_connect`; the first failure of each kind said in one line (tensorstore only sees a connection reset,
        retries, and its save fails as the storage's)."""
        try:
            return await self._connect()
        except OSError as err:
            said = f"{type(err).__name__}: {err}"
            if said not in self.said:
                self.said.add(said)
                print(f"storage: tensorstore's requests (through the fence, control/fence_proxy.py) cannot reach "
                      f"{self.host}:{self.port}: {said}", file=sys.stderr, flush=True)
            raise

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """Requests from tensorstore, one after another on this connection, each sent on through the fence: checked
        before its first byte and before each CHUNK of its body."""
        up_w = back = None
        try:
            while (head := await _head(client_r)) is not None:
                await asyncio.to_thread(fence.check_streams)
                if up_w is None:
                    up_r, up_w = await self._connect_or_say()
                    back = asyncio.ensure_future(_pipe(up_r, client_w))
                up_w.write(_with_host(head, self.netloc))
                unchecked = CHUNK  # the first piece is checked too
                async for piece in _body(client_r, head):
                    if unchecked + len(piece) > CHUNK:
                        await asyncio.to_thread(fence.check_streams)
                        unchecked = 0
                    unchecked += len(piece)
                    up_w.write(piece)
                    await up_w.drain()
                await up_w.drain()
        except RunFailure:  # the lease is not held: the request goes no further, the connection ends mid-request
            self.refused += 1
        except (OSError, ValueError, EOFError):
            pass  # either end went away: tensorstore retries on a new connection
        finally:
            for writer in (up_w, client_w):
                if writer is not None:
                    writer.transport.abort()
            if back is not None:
                back.cancel()


async def _head(reader: asyncio.StreamReader) -> bytes | None:
    """A request's header block (request line to blank line), None at the end of the connection."""
    lines = []
    while True:
        line = await reader.readline()
        if not line:
            if lines:
                raise ValueError("a request cut off in its header")
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return b"".join(lines)


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def _with_host(head: bytes, netloc: bytes) -> bytes:
    """`head` with its Host header naming the real endpoint."""
    lines = head.split(b"\r\n")
    return b"\r\n".join(b"Host: " + netloc if line.lower().startswith(b"host:") else line for line in lines)


async def _body(reader: asyncio.StreamReader, head: bytes):
    """A request's body as it arrives, in pieces of up to CHUNK bytes (raw, chunked framing included)."""
    length = _header(head, b"content-length")
    if length is not None:
        async for piece in _exactly(reader, int(length)):
            yield piece
        return
    if (_header(head, b"transfer-encoding") or b"").lower() != b"chunked":
        return
    while True:
        size_line = await reader.readline()
        size = int(size_line.split(b";")[0], 16)
        yield size_line
        async for piece in _exactly(reader, size + 2):  # the chunk and its CRLF
            yield piece
        if size == 0:  # the last chunk (no trailers from libcurl): its CRLF was the block's end
            return


async def _exactly(reader: asyncio.StreamReader, left: int):
    """The next `left` bytes of the request, in pieces of up to CHUNK bytes."""
    while left:
        piece = await reader.read(min(CHUNK, left))
        if not piece:
            raise ValueError("a request cut off in its body")
        left -= len(piece)
        yield piece


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers back to tensorstore, unread, until either end closes."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (OSError, ValueError):
        pass
    finally:
        writer.close()  # after what is buffered for tensorstore
