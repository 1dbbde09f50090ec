"""The two GCS clients a run uses, set up once per process so that a bucket that throttles or fails is retried,
and an endpoint that cannot be reached fails in bounded time with one line (g2rl_jax.storage calls `configure` at
the first URL it meets, and `check_writable` before anything heavy):

- gcsfs (every file the project writes itself, through etils epath): each request gives up when connecting or
  waiting for an answer stalls for `request_seconds()`; gcsfs then retries 429, 5xx, timeouts and dropped
  connections itself, with exponential backoff (1, 2, 4, 8, 16 s plus up to 1 s of jitter; fixed in gcsfs), in
  `gcsfs_attempts()` attempts: its own 6, fewer when they would not fit the budget;
- tensorstore (Orbax's checkpoint writer, its own HTTP client and credentials): libcurl gives up a connection not
  made in `request_seconds()` (TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS) and a request that moves under 1 byte/s for
  `request_seconds()` (TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS / _LIMIT_BYTES; read once per process, at its first
  request; values already in the environment are kept); the context resource `gcs_request_retries` of Orbax's
  tensorstore contexts is `tensorstore_retries()` (429, 5xx and transport errors retried with exponential backoff
  from 1 s up to 16 s, as many times as fit the budget). tensorstore has no per-request deadline of its own.

The budget: $G2RL_JAX_STORAGE_TIMEOUT seconds (default 120) for a call whose endpoint does not answer; a request's
stall limit is what leaves room for gcsfs's 6 attempts and their backoff in it (under 48 s, where they do not fit
at the least stall limit, 2 s: as many attempts as fit, 2 at the least budget, 10 s), and tensorstore's retries are
as many as fit in it at that stall limit. `check_writable` writes and deletes a probe through both clients, each
under that deadline, and turns a failure into one line naming the URL and the likely cause: a variable missing from
an emulator's set, no credentials, a denied permission, a closed port, a server that accepts and does not answer.
The gcsfs filesystem `configure` registers (paced, fenced, its failures typed): g2rl_jax/storage_paced.py.
"""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import urllib.parse

TIMEOUT_ENV = "G2RL_JAX_STORAGE_TIMEOUT"
GCSFS_BACKOFF_S = 36.0  # gcsfs's 5 sleeps between its 6 attempts, at most
GCSFS_ATTEMPTS = 6  # gcsfs's own attempts per request
TS_MAX_RETRIES = 6
TS_DELAYS = {"initial_delay": "1s", "max_delay": "16s"}  # tensorstore's backoff: 1 s doubling to 16 s, + <= 1 s jitter
TS_ATTEMPT_OVERHEAD_S = 3.0  # measured: a stalled attempt ends 2-2.6 s after libcurl's stall limit (its checks)
# what `python -m g2rl_jax.bench.gcs_emulator` exports: the clients need all of them to use an emulator
EMULATOR_VARIABLES = {
    "TENSORSTORE_GCS_HTTP_URL": "the emulator's address, for tensorstore (Orbax's checkpoint writer)",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "any token, so that tensorstore looks for no Google credentials",
    "FSSPEC_GCS_TOKEN": "anon, so that gcsfs looks for no Google credentials",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false, so that gcsfs does not ask Google's control API (gRPC over TLS, "
                                         "which an emulator does not speak) about the bucket",
}
_CONFIGURED = False


def timeout_seconds() -> float:
    """$G2RL_JAX_STORAGE_TIMEOUT (default 120): the bound on a storage call whose endpoint does not answer."""
    from g2rl_jax.storage import StorageError

    raw = os.environ.get(TIMEOUT_ENV) or "120"
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value < 10:
        raise StorageError(f"{TIMEOUT_ENV}={raw!r}: give the seconds a storage call may take before it fails "
                           "(at least 10; default 120)")
    return value


def request_seconds() -> float:
    """One request's stall limit: 6 such attempts and gcsfs's backoff fit in timeout_seconds()."""
    return max(2.0, (timeout_seconds() - GCSFS_BACKOFF_S) / 6)


def gcsfs_attempts() -> int:
    """gcsfs's attempts per request: as many as fit timeout_seconds() (up to its own 6), each stalled for
    request_seconds() and each retry after its backoff of 2^i s and up to 1 s of jitter: 6 at the default 120 s,
    2 at the least, 10 s (a failing call then ends in the budget, not 33 s of backoff later)."""
    stall = request_seconds()

    def worst(attempts: int) -> float:
        return attempts * stall + sum(2.0 ** i + 1.0 for i in range(attempts - 1))

    attempts = 1
    while attempts < GCSFS_ATTEMPTS and worst(attempts + 1) <= timeout_seconds():
        attempts += 1
    return attempts


def tensorstore_retries() -> dict:
    """tensorstore's gcs_request_retries: the most retries (up to TS_MAX_RETRIES) whose worst case, every attempt
    stalled for request_seconds() and each followed by its backoff, fits in timeout_seconds(): 4 at the default 120 s
    (worst case 104 s), at least 1 (worst case 12 s at the smallest stall limit, 2 s)."""
    attempt = request_seconds() + TS_ATTEMPT_OVERHEAD_S

    def worst(retries: int) -> float:  # (retries + 1) attempts and `retries` sleeps of min(2^i, 16) s + 1 s jitter
        return (retries + 1) * attempt + sum(min(2.0 ** i, 16.0) + 1.0 for i in range(retries))

    retries = 1
    while retries < TS_MAX_RETRIES and worst(retries + 1) <= timeout_seconds():
        retries += 1
    return {"max_retries": retries, **TS_DELAYS}


def tensorstore_environment() -> dict[str, str]:
    """The libcurl limits of tensorstore's HTTP client: a connection not made, or a request that moves under 1 byte
    a second, for request_seconds() is given up (and retried)."""
    stall = str(int(request_seconds()))
    return {"TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS": stall, "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": stall,
            "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": "1"}


def emulator_problem() -> str | None:
    """With STORAGE_EMULATOR_HOST set, what is missing from the rest of the emulator's variables (None if none)."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return None
    missing = [f"{name} is not set (it must be {why})" for name, why in EMULATOR_VARIABLES.items()
               if not os.environ.get(name)]
    if os.environ.get("TENSORSTORE_GCS_HTTP_URL") and os.environ["TENSORSTORE_GCS_HTTP_URL"] != host:
        missing.append(f"TENSORSTORE_GCS_HTTP_URL={os.environ['TENSORSTORE_GCS_HTTP_URL']} differs from "
                       f"STORAGE_EMULATOR_HOST={host} (checkpoints would go to another server)")
    if os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "").lower() not in ("", "false", "0"):
        missing.append("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT is " + os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] +
                       " (it must be " + EMULATOR_VARIABLES["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] + ")")
    if not missing:
        return None
    return (f"STORAGE_EMULATOR_HOST={host} points the clients at an emulator, but {'; '.join(missing)}; export the "
            "whole line that `python -m g2rl_jax.bench.gcs_emulator` prints (docs/running.md), or unset "
            "STORAGE_EMULATOR_HOST to use Google Cloud Storage")


def configure() -> None:
    """Once per process, before the first request: the emulator's variables checked (StorageError naming what is
    missing), gcsfs's request timeouts and listings cache, tensorstore's retries, connect and stall limits."""
    global _CONFIGURED
    if _CONFIGURED:
        return
    from g2rl_jax.control import fence_proxy
    from g2rl_jax.storage import StorageError

    fence_proxy.inherited()  # a parent's forwarder is not this process's
    problem = emulator_problem()
    if problem:
        raise StorageError(problem)
    import aiohttp
    import fsspec

    stall = request_seconds()
    for protocol in ("gcs", "gs"):
        conf = fsspec.config.conf.setdefault(protocol, {})
        conf.setdefault("use_listings_cache", False)  # hosts that share a bucket must see each other's writes
        conf.setdefault("requests_timeout", aiohttp.ClientTimeout(total=None, sock_connect=stall, sock_read=stall))
    from g2rl_jax import storage_paced

    storage_paced.register()
    for name, value in tensorstore_environment().items():
        os.environ.setdefault(name, value)
    set_orbax_retries(tensorstore_retries())
    _CONFIGURED = True


def set_orbax_retries(retries: dict) -> None:
    """`retries` as gcs_request_retries in every tensorstore context Orbax builds. Orbax (0.12.8, as installed)
    builds them in tensorstore_utils.get_ts_context from two private module-level dicts, with no public way to add a
    context resource (no option of CheckpointManagerOptions or of the handlers takes a tensorstore Context, and the
    handlers, the metadata reader and the multi-process OCDBT merge each call get_ts_context themselves), so this
    is the one place that patches those dicts, and it checks that a context built afterwards carries `retries`:
    an Orbax whose internals moved fails here, in one line, instead of saving with tensorstore's defaults (32
    retries up to 32 s apart, minutes past the storage budget)."""
    import tensorstore as ts

    from g2rl_jax.storage import StorageError

    want = ts.Context({"gcs_request_retries": retries})["gcs_request_retries"].to_json()
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils

        for name in ("_BASE_TS_CONTEXT", "_DEFAULT_OCDBT_TS_CONTEXT"):
            getattr(tensorstore_utils, name)["gcs_request_retries"] = dict(retries)
        got = [tensorstore_utils.get_ts_context(use_ocdbt=ocdbt)["gcs_request_retries"].to_json()
               for ocdbt in (False, True)]
    except Exception as err:  # noqa: BLE001 - any change of Orbax's internals is the one line below
        got = [f"{type(err).__name__}: {err}"]
    if got != [want, want]:
        raise StorageError(f"this orbax-checkpoint builds its tensorstore contexts differently ({got[0]}); install "
                           "orbax-checkpoint 0.12.8, or update g2rl_jax/storage_clients.py's set_orbax_retries")


# ------------------------------------------------------------------------------------------------ GCS requests
_OBJECT = re.compile(r"^/storage/v1/b/([^/]+)/o/([^/?]+)(?:/(compose|copyTo|rewriteTo)(?:/b/([^/]+)/o/([^/?]+))?)?$")
_UPLOAD = re.compile(r"^/upload/storage/v1/b/([^/]+)/o$")
_NAME_IN_BODY = re.compile(rb'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
UPDATES = ("upload", "compose", "copy", "delete", "patch")  # the kinds that update the object they name


def classify(method: str, path: str, query: dict, body: bytes, uploads: dict) -> tuple[str, str | None]:
    """(kind, "bucket/name") of a GCS JSON-API request: "start" (a resumable upload begun; `uploads` maps its id to
    the object once the answer names the id), "upload", "compose", "copy" (onto the destination), "delete",
    "patch", "read", "list" or "other"."""
    match = _UPLOAD.match(path)
    if match:
        if "upload_id" in query:  # a resumable upload's data: the object its start named
            return "upload", uploads.get(query["upload_id"])
        name = query.get("name")
        if name is None:  # a multipart upload or a resumable start: the name is in the JSON metadata
            found = _NAME_IN_BODY.search(body[:65536])
            name = json.loads(b'"' + found.group(1) + b'"') if found else None
        kind = "start" if query.get("uploadType") == "resumable" else "upload"
        return kind, f"{match.group(1)}/{name}" if name else None
    match = _OBJECT.match(path)
    if match:
        bucket, name, verb, dst_bucket, dst_name = match.groups()
        if verb == "compose":
            return "compose", f"{bucket}/{urllib.parse.unquote(name)}"
        if verb:  # copyTo / rewriteTo: the destination is updated
            return "copy", f"{dst_bucket}/{urllib.parse.unquote(dst_name)}"
        return {"DELETE": "delete", "PATCH": "patch", "PUT": "patch"}.get(method, "read"), \
            f"{bucket}/{urllib.parse.unquote(name)}"
    if path.startswith("/download/storage/v1/b/"):
        parts = path.split("/", 7)
        return "read", f"{parts[5]}/{urllib.parse.unquote(parts[7])}" if len(parts) > 7 else None
    return ("list" if path.endswith("/o") and method == "GET" else "other"), None


# ------------------------------------------------------------------------------------------------ checks
def _within(seconds: float, what: str, call):
    """call() in a thread, TimeoutError naming `what` if it has not returned within `seconds`."""
    box: dict = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread below
            box["error"] = err

    worker = threading.Thread(target=run, daemon=True, name=f"storage-check-{what}")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"{what} did not answer in {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _tensorstore_probe(probe) -> None:
    """Write object `probe` through tensorstore's gcs driver, with the retries Orbax will use (gcsfs deletes it)."""
    import tensorstore as ts

    from g2rl_jax import storage_append

    bucket, _, name = str(probe).split("://", 1)[1].partition("/")
    store = ts.KvStore.open({"driver": "gcs", "bucket": bucket,
                             "context": {"gcs_request_retries": tensorstore_retries()}}).result()
    with storage_append._update(probe):  # its delete waits out the second after this write
        store.write(name, b"ok").result()


def _start_error(err: BaseException) -> type:
    """The class of a start check's one line: StorageUnreachable when the store did not serve the check (the
    trainer's exit code then is the storage's: relaunch later), else StorageError (what to fix)."""
    from g2rl_jax import storage
    from g2rl_jax.control.errors import StorageUnavailable

    return storage.StorageUnreachable if isinstance(err, (StorageUnavailable, TimeoutError)) else storage.StorageError


def check_writable(directory, key: str, probe_name: str = ".write_test") -> None:
    """StorageError naming `key`, the path and the fix when `directory` cannot be written: a bucket that does not
    exist, no credentials, permission denied, an endpoint that cannot be reached, an unwritable local directory.
    Writes and deletes one small probe file (`probe_name`: one per process when hosts share the directory) through
    gcsfs and, for gs://, through tensorstore too, each within timeout_seconds()."""
    from g2rl_jax import storage

    url = storage.is_url(directory)
    try:
        storage.require_client(directory, key)
        deadline = timeout_seconds()
    except storage.StorageError as err:
        raise storage.StorageError(str(err) if str(err).startswith(key) else f"{key}: {err}") from None

    probes = [storage.path(directory, key) / probe_name]
    steps = [("gcsfs", lambda: (storage.makedirs(directory), storage.write_text(probes[0], "ok")))]
    if storage.scheme(directory) in ("gs", "gcs"):
        probes.append(storage.path(directory, key) / f"{probe_name}.tensorstore")
        steps.append(("tensorstore", lambda: _tensorstore_probe(probes[1])))
    steps.append(("gcsfs", lambda: [storage.remove(p) for p in probes]))  # paced: a second after each write
    for client, step in steps:
        try:
            _within(deadline, client, step) if url else step()
        except Exception as err:  # noqa: BLE001 - every failure becomes the one line below, the cause named in it
            raise _start_error(err)(f"{key}: {explain(directory, err, client)}") from None


def check_readable(p, key: str) -> None:
    """StorageError naming `key` when `p` (a URL) cannot be reached to be read within timeout_seconds(): a server
    that went away, a closed port, no credentials (a missing object is no error here)."""
    from g2rl_jax import storage

    if not storage.is_url(p):
        return
    storage.require_client(p, key)
    try:
        _within(timeout_seconds(), "gcsfs", lambda: storage.exists(p))
    except Exception as err:  # noqa: BLE001 - every failure becomes the one line below, the cause named in it
        raise _start_error(err)(f"{key}: {explain(p, err, 'gcsfs', 'read')}") from None


def _endpoint(client: str) -> str:
    """The endpoint `client` talks to."""
    variable = "TENSORSTORE_GCS_HTTP_URL" if client == "tensorstore" else "STORAGE_EMULATOR_HOST"
    return os.environ.get(variable) or "https://storage.googleapis.com"


def _reachability(endpoint: str) -> str | None:
    """Why `endpoint` cannot serve requests, from a TCP connection and one HTTP request (None if it answers)."""
    parts = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=5) as conn:
            conn.settimeout(5)
            conn.sendall(f"GET /storage/v1/b HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            answer = conn.recv(64)
            if not answer:
                return f"{host}:{port} accepts connections and closes them without an answer"
            status = answer.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            if len(status) > 1 and status[1] in ("429", "500", "502", "503", "504"):  # a failing service, not the path
                return f"{host}:{port} answers every request {' '.join(status[1:])} (the service is failing)"
    except ConnectionRefusedError:
        return f"nothing listens on port {port} of {host} (is the server running, on that port?)"
    except socket.timeout:
        return f"{host}:{port} accepts connections but does not answer (a hung server, or not a GCS endpoint)"
    except OSError as err:
        return f"cannot connect to {host}:{port} ({err}; check the address and the network)"
    return None


def _credentials_missing(err: BaseException) -> bool:
    import google.auth.exceptions

    return getattr(err, "code", None) == 401 or isinstance(err, (google.auth.exceptions.DefaultCredentialsError,
                                                                 google.auth.exceptions.RefreshError))


def explain(directory, err: BaseException, client: str = "gcsfs", verb: str = "write") -> str:
    """What a failed `verb` of `directory` through `client` means and what to do, from the client's error's type
    (and status) and, when the store did not serve it, a look at its endpoint (`_reachability`)."""
    from g2rl_jax import storage
    from g2rl_jax.control.errors import StorageUnavailable

    if isinstance(err, StorageUnavailable):
        err = err.cause
    detail = " ".join(str(err).split())[:300]
    if not storage.is_url(directory):
        return f"cannot write to {str(directory)!r} ({detail}); choose a writable directory"
    url = str(directory)
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    if isinstance(err, FileNotFoundError) or getattr(err, "code", None) == 404:
        return (f"the bucket {storage.scheme(url)}://{bucket} does not exist (writing {url}); create it (gcloud "
                f"storage buckets create {storage.scheme(url)}://{bucket}) or fix the name")
    if _credentials_missing(err):
        return (f"no Google Cloud credentials to write {url} ({detail}); run `gcloud auth application-default "
                "login`, set GOOGLE_APPLICATION_CREDENTIALS to a service-account key, or run on a VM whose service "
                "account may write the bucket")
    if isinstance(err, PermissionError) or getattr(err, "code", None) == 403:
        return (f"permission denied writing {url} ({detail}); grant this machine's account roles/storage.objectUser "
                f"on {storage.scheme(url)}://{bucket} (gcloud storage buckets add-iam-policy-binding), or choose a "
                "bucket it may write")
    endpoint = _endpoint(client)
    why = _reachability(endpoint)
    if why or isinstance(err, TimeoutError):
        return (f"{client} cannot reach {endpoint} to {verb} {url}: {why or detail} ({type(err).__name__}: {detail}); "
                f"check STORAGE_EMULATOR_HOST / TENSORSTORE_GCS_HTTP_URL if you use an emulator, else the network "
                f"(each storage call gives up after {TIMEOUT_ENV}={timeout_seconds():.0f} s)")
    return f"{client} cannot {verb} {url} ({type(err).__name__}: {detail}); check the path and the network"
