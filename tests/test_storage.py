"""g2rl_jax.storage against a real GCS server on loopback (fake-gcs-server, g2rl_jax/bench/gcs_emulator.py) and a local
directory, the same calls on both: whole writes, appends (compose on GCS), the exclusive create of the lock
(ifGenerationMatch=0 on GCS), moves, copies of a bucket directory to the local cache, and the one-line errors for a
missing client, a missing bucket, missing credentials and a denied permission."""
import http.server
import json
import sys
import threading

import pytest

from g2rl_jax import storage


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path, gcs):
    return str(tmp_path / "run") if request.param == "local" else gcs.url(f"storage/{request.node.originalname}")


def test_write_read_append_and_list(root):
    storage.makedirs(root)
    storage.write_text(f"{root}/config.yaml", "a: 1\n")
    storage.write_text(f"{root}/config.yaml", "a: 2\n")  # replaced whole
    assert storage.read_text(f"{root}/config.yaml") == "a: 2\n"
    for i in range(3):
        storage.append_text(f"{root}/metrics.jsonl", json.dumps({"step": i}) + "\n")
    appender = storage.Appender(f"{root}/metrics.jsonl")
    appender.write('{"step": 3}\n')
    appender.write('{"step": 4}\n')
    appender.close()
    lines = storage.read_text(f"{root}/metrics.jsonl").splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3, 4]
    assert storage.names(root) == ["config.yaml", "metrics.jsonl"]  # no part objects or temporary files left
    assert storage.is_file(f"{root}/config.yaml") and not storage.is_file(f"{root}/nothing")
    assert storage.names(f"{root}/nothing") == []


def test_exclusive_create_admits_one(root):
    storage.makedirs(root)
    assert storage.create_exclusive(f"{root}/run.lock", "first\n")
    assert not storage.create_exclusive(f"{root}/run.lock", "second\n")
    assert storage.read_text(f"{root}/run.lock") == "first\n"
    before = storage.generation(f"{root}/run.lock")
    storage.remove(f"{root}/run.lock")
    assert storage.create_exclusive(f"{root}/run.lock", "third\n")
    assert storage.generation(f"{root}/run.lock") != before


def test_move_a_directory_aside(root):
    for name in ("a.txt", "sub/b.txt"):
        storage.write_text(f"{root}/checkpoints/3/{name}", name)
    storage.write_text(f"{root}/corrupt/3/old.txt", "stale")
    storage.makedirs(f"{root}/corrupt")
    storage.move(f"{root}/checkpoints/3", f"{root}/corrupt/3")
    assert not storage.exists(f"{root}/checkpoints/3")
    assert storage.read_text(f"{root}/corrupt/3/sub/b.txt") == "sub/b.txt"
    assert not storage.exists(f"{root}/corrupt/3/old.txt")  # the target was replaced, not merged


def test_local_copy_of_a_bucket_directory(gcs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    url = gcs.url("models/tiny")
    storage.write_text(f"{url}/config.json", "{}")
    storage.write_bytes(f"{url}/model.safetensors", b"\0" * 1000)
    first = storage.local_copy(url, "model.path")
    assert "copying" in capsys.readouterr().err
    assert open(f"{first}/model.safetensors", "rb").read() == b"\0" * 1000
    assert storage.local_copy(url, "model.path") == first and capsys.readouterr().err == ""  # copied once
    storage.write_text(f"{url}/config.json", '{"changed": true}')
    second = storage.local_copy(url, "model.path")  # another version: another directory
    assert second != first and "copying" in capsys.readouterr().err
    assert open(f"{second}/config.json").read() == '{"changed": true}'
    assert open(f"{first}/config.json").read() == "{}"  # left whole for a process still reading it
    with pytest.raises(FileNotFoundError, match="model.path: nothing found at gs://"):
        storage.local_copy(gcs.url("models/absent"), "model.path")


def test_missing_bucket_is_one_line(gcs):
    with pytest.raises(storage.StorageError, match=r"run.output_dir: the bucket gs://no-such-bucket does not exist "
                                                   r".*gcloud storage buckets create gs://no-such-bucket"):
        storage.check_writable("gs://no-such-bucket/runs/x", "run.output_dir")
    storage.check_writable(gcs.url("runs/x"), "run.output_dir")  # the bucket exists: fine, and no probe left
    assert storage.names(gcs.url("runs/x")) == []


def test_unwritable_local_directory_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(storage.StorageError, match="run.output_dir: cannot write to .*choose a writable directory"):
        storage.check_writable(tmp_path / "file" / "run", "run.output_dir")


def test_gs_without_the_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if the gcs extra were not installed
    with pytest.raises(storage.StorageError, match=r"run.output_dir: 'gs://b/r' is a gs:// path, which needs the "
                                                   r"gcsfs package: pip install -e \"\.\[gcs\]\""):
        storage.path("gs://b/r", "run.output_dir")


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Answers every request as GCS answers a caller it refuses (status and JSON error body)."""

    status, message = 403, "x does not have storage.objects.create access"

    def _answer(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"error": {"code": self.status, "message": self.message}}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status,message,match", [
    (401, "Anonymous caller does not have storage.objects.create access to the Google Cloud Storage object.",
     r"run.output_dir: no Google Cloud credentials to write gs://b/run .*gcloud auth application-default login"),
    (403, "sa@p.iam.gserviceaccount.com does not have storage.objects.create access",
     r"run.output_dir: permission denied writing gs://b/run .*roles/storage.objectUser on gs://b"),
])
def test_credentials_and_permission_errors_are_one_line(gcs, monkeypatch, status, message, match):
    """Neither emulator checks credentials, so a loopback server answers as GCS does when it refuses a caller (the
    status and JSON body of its documented errors); what is tested is the line a user gets from that answer."""
    handler = type("Refusing", (_Refusing,), {"status": status, "message": message})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.server_port}")  # read per request
        with pytest.raises(storage.StorageError, match=match) as err:
            storage.check_writable("gs://b/run", "run.output_dir")
        assert "\n" not in str(err.value)
    finally:
        server.shutdown()
