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


def test_appends_are_conditional_on_the_version_last_seen(root):
    """Two writers never overwrite each other, locally and on GCS: a first write only where nothing is, and an append
    conditional on a version another writer changed since (an append, a rewrite) is refused with
    storage.ObjectChanged and writes nothing; an Appender whose file another writer changed stops there."""
    url = f"{root}/records.jsonl"
    storage.makedirs(root)
    first = storage.append_text(url, "a\n", expected=storage.ABSENT)
    with pytest.raises(storage.ObjectChanged):
        storage.append_text(url, "x\n", expected=storage.ABSENT)  # a second first write
    second = storage.append_text(url, "b\n", expected=first.version)
    with pytest.raises(storage.ObjectChanged):
        storage.append_text(url, "x\n", expected=first.version)  # b came after what this writer saw
    storage.write_text(url, "a\n")  # rewritten whole (a resumed run's truncation)
    with pytest.raises(storage.ObjectChanged, match="changed by another writer"):
        storage.append_text(url, "x\n", expected=second.version)
    assert storage.read_text(url) == "a\n"
    appender = storage.Appender(url)
    appender.write("c\n")
    appender.flush()
    storage.append_text(url, "d\n")  # a one-off append reads the version itself
    with pytest.raises(storage.ObjectChanged):
        appender.write("x\n")  # locally written through at once
        appender.flush()
    assert storage.read_text(url) == "a\nc\nd\n"


@pytest.mark.parametrize("fault", ["lost", "lost503"])
def test_appends_applied_with_their_reply_lost_land_once(gcs, fault):
    """'Applied, reply dropped' (g2rl_jax/bench/gcs_faults.py): the server applies the request and the client's
    answer is a dropped connection (lost) or a 503 (lost503), so gcsfs retries a request that landed. Every first
    write and compose of the object meets it here, and each line is in the object once: the retried compose fails its
    precondition and what is stored shows that it landed (an unconditional compose doubled the line)."""
    from g2rl_jax.bench.gcs_faults import Rule

    url = gcs.url(f"storage/{fault}/metrics.jsonl")
    appender = storage.Appender(url, interval=1.0)
    for i in range(3):  # the first write, then two composes: each one's first attempt meets the fault
        rule = gcs.proxy.plan.add(Rule(fault, kinds=("upload", "compose"), obj=url.removeprefix("gs://"), count=1))
        appender.write(json.dumps({"step": i}) + "\n")
        appender.flush()
        assert rule.served == 1
    appender.close()
    assert [json.loads(line)["step"] for line in storage.read_text(url).splitlines()] == [0, 1, 2]
    assert storage.names(gcs.url(f"storage/{fault}")) == ["metrics.jsonl"]


def test_the_proxy_keeps_gcs_preconditions_of_compose_and_delete(gcs):
    """fake-gcs-server applies a compose whatever its ifGenerationMatch, keeps the object's generation, and deletes
    whatever a delete's ifGenerationMatch says; through the proxy each is as on GCS."""
    fs, key = storage._fs(gcs.url("storage/preconditions/a"))
    bucket, name = key.split("/", 1)
    storage.write_text(gcs.url("storage/preconditions/a"), "1")
    storage.write_text(gcs.url("storage/preconditions/b"), "2")
    before = storage.generation(gcs.url("storage/preconditions/a"))
    body = {"sourceObjects": [{"name": name}, {"name": name[:-1] + "b"}], "destination": {"name": name}}
    reply = fs.call("POST", "b/{}/o/{}/compose", bucket, name, ifGenerationMatch=before, json=body, json_out=True)
    assert reply["generation"] != before and storage.read_text(gcs.url("storage/preconditions/a")) == "12"
    with pytest.raises(FileExistsError):  # 412: the generation moved on
        fs.call("POST", "b/{}/o/{}/compose", bucket, name, ifGenerationMatch=before, json=body, json_out=True)
    assert not storage.remove_if_generation(gcs.url("storage/preconditions/a"), before)
    assert storage.read_text(gcs.url("storage/preconditions/a")) == "12"
    assert storage.remove_if_generation(gcs.url("storage/preconditions/a"), str(reply["generation"]))
    storage.remove(gcs.url("storage/preconditions/b"))
    assert storage.names(gcs.url("storage/preconditions")) == []


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


# ------------------------------------------------------------------------------------------------ GCS as it is
def _upload(endpoint: str, name: str, data: bytes) -> int:
    """One media upload of gs://g2rl-test/<name> straight to `endpoint` (no client retries); the HTTP status."""
    import urllib.error
    import urllib.parse
    import urllib.request

    url = f"{endpoint}/upload/storage/v1/b/g2rl-test/o?uploadType=media&name={urllib.parse.quote(name, safe='')}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method="POST"), timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code


def test_the_proxy_refuses_a_second_update_within_a_second(gcs):
    """The strict proxy (g2rl_jax/bench/gcs_proxy.py) answers 429 as GCS may to a second update of one object within
    a second, counts it, and lets the update through a second later; other objects are not held back."""
    import time

    from g2rl_jax.bench.gcs_proxy import Faults, GcsProxy

    with GcsProxy(gcs.server, faults=Faults()) as proxy:  # no faults: only the rate is tested here
        assert _upload(proxy.endpoint, "storage/rate/a", b"1") == 200
        assert _upload(proxy.endpoint, "storage/rate/b", b"1") == 200
        assert _upload(proxy.endpoint, "storage/rate/a", b"2") == 429
        assert proxy.served_429 == 1 and proxy.throttled() == {"g2rl-test/storage/rate/a": 1}
        time.sleep(1.05)
        assert _upload(proxy.endpoint, "storage/rate/a", b"3") == 200
    assert storage.read_text(gcs.url("storage/rate/a")) == "3"


def test_buffered_appends_update_an_object_once_a_second_and_leave_no_part(gcs):
    """An Appender written 40 times in about 2 s: the object gets every line in order, through the strict proxy's
    faults, with at most one update a second and no 429; a part left by a killed writer is deleted at the next
    start, a live writer's own is kept."""
    import time

    url = gcs.url("storage/buffered/metrics.jsonl")
    before = len(gcs.proxy.log)
    appender = storage.Appender(url, interval=1.0)
    for i in range(40):
        appender.write(json.dumps({"step": i}) + "\n")
        time.sleep(0.05)
    appender.close()
    assert [json.loads(line)["step"] for line in storage.read_text(url).splitlines()] == list(range(40))
    mine = [r for r in gcs.proxy.log[before:] if r.obj == url[len("gs://"):]]
    updates = [r.t for r in mine if r.kind in ("upload", "compose") and r.status == 200]
    assert 2 <= len(updates) < 10 and not [r for r in mine if r.status == 429], mine  # batched, never refused
    assert min(b - a for a, b in zip(updates, updates[1:])) >= 0.95, updates  # at most one update a second
    assert storage.names(gcs.url("storage/buffered")) == ["metrics.jsonl"]
    orphan = gcs.url("storage/buffered/.metrics.jsonl.part.vm-a.123.0badf00d")  # a killed writer's
    own = storage.append_bytes(url, b"x\n", delete_part=False).part  # this process's, still in use
    storage.write_text(orphan, "lost\n")
    assert storage.remove_orphan_parts(gcs.url("storage/buffered")) == [orphan.rsplit("/", 1)[1]]
    assert storage.exists(own) and not storage.exists(orphan)
    storage.remove(own)


def _check_in_a_fresh_process(env: dict, url: str = "gs://g2rl-test/run"):
    """check_writable(url) in a new process (the clients read their settings once per process): (seconds, result)."""
    import subprocess
    import time

    code = ("import sys\nfrom g2rl_jax import storage\n"
            f"try:\n    storage.check_writable({url!r}, 'run.output_dir')\n"
            "except storage.StorageError as err:\n    print(err, file=sys.stderr)\n    sys.exit(2)\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return time.monotonic() - t0, done


def _emulator_env(gcs, endpoint: str) -> dict:
    import os

    return dict(os.environ, **{k: endpoint if v == gcs.endpoint else v for k, v in gcs.env.items()},
                G2RL_JAX_STORAGE_TIMEOUT="10")  # the least: what bounds the failures is waited out


def _last_line(done) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(("I1", "W0", "E0"))]
    return lines[-1]


def test_a_closed_port_fails_in_bounded_time_with_one_line(gcs):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seconds, done = _check_in_a_fresh_process(_emulator_env(gcs, f"http://127.0.0.1:{port}"))
    line = _last_line(done)
    assert f"nothing listens on port {port} of 127.0.0.1" in line and "gs://g2rl-test/run" in line, line
    assert seconds < 60, seconds


@pytest.mark.parametrize("budget,attempts", [(10, 2), (15, 3), (30, 5), (47, 5), (48, 6), (120, 6), (600, 6)])
def test_gcsfs_attempts_fit_the_storage_budget(monkeypatch, budget, attempts):
    """gcsfs's attempts per request: the most (up to its own 6) whose worst case, every attempt stalled for the
    stall limit S = max(2, (budget - 36) / 6) and each retry after 2^i s + 1 s of jitter, fits the budget."""
    from g2rl_jax import storage_clients

    monkeypatch.setenv(storage_clients.TIMEOUT_ENV, str(budget))
    stall = max(2.0, (budget - 36.0) / 6.0)
    worst = [n * stall + (2.0 ** (n - 1) - 1.0) + (n - 1) for n in range(1, 8)]  # 1 + 2 + ... + 2^(n-2), n - 1 s
    assert worst[attempts - 1] <= budget and (attempts == 6 or worst[attempts] > budget)
    assert storage_clients.gcsfs_attempts() == attempts


def test_a_server_that_never_answers_fails_in_bounded_time_with_one_line(gcs):
    import socket

    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        seconds, done = _check_in_a_fresh_process(_emulator_env(gcs, f"http://127.0.0.1:{port}"))
    line = _last_line(done)
    assert f"127.0.0.1:{port} accepts connections but does not answer" in line and "G2RL_JAX_STORAGE_TIMEOUT" in line
    assert seconds < 60, seconds


def test_half_set_emulator_variables_are_one_line_at_once(gcs):
    """The export line without its last four variables (the trainer printed gRPC handshake errors for 18 minutes
    that way): one line naming the missing variable, before any request."""
    env = _emulator_env(gcs, gcs.endpoint)
    for name in ("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "GCE_METADATA_HOST", "GCE_METADATA_IP", "NO_GCE_CHECK"):
        env.pop(name)
    seconds, done = _check_in_a_fresh_process(env)
    line = _last_line(done)
    assert "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT is not set (it must be false" in line, line
    assert "python -m g2rl_jax.bench.gcs_emulator" in line and seconds < 60


def test_eval_of_a_checkpoint_whose_server_went_away_is_one_line(gcs, tmp_path):
    """`eval --checkpoint gs://...` with the bucket's server gone (its port closed): one line naming the URL and the
    closed port, within the bounded time, before any model loads (it used to hang until killed)."""
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"problem": "1+2", "answer": "3"}) + "\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "g2rl_jax.eval", "--checkpoint", "gs://g2rl-test/runs/gone",
                           "--datasets", str(data), "--out", str(tmp_path / "eval")],
                          env=_emulator_env(gcs, f"http://127.0.0.1:{port}"), capture_output=True, text=True,
                          timeout=300)
    line = _last_line(done)
    assert line.startswith("eval error: --checkpoint: gcsfs cannot reach") and "gs://g2rl-test/runs/gone" in line
    assert f"nothing listens on port {port}" in line and time.monotonic() - t0 < 90, line


def test_the_trainer_with_half_set_emulator_variables_is_one_line(gcs):
    """The case that printed gRPC handshake errors for 18 minutes: the trainer on a gs:// run.output_dir with the
    emulator's address but without the export line's last four variables. One line, before any model loads."""
    import pathlib
    import subprocess

    env = _emulator_env(gcs, gcs.endpoint)
    for name in ("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "GCE_METADATA_HOST", "GCE_METADATA_IP", "NO_GCE_CHECK"):
        env.pop(name)
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "g2rl_jax.train", "--config", str(root / "configs" / "demo.yaml"),
                           f"run.output_dir={gcs.url('storage/half_set')}"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=root)
    line = _last_line(done)
    assert line.startswith("config error: ") and "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT is not set" in line, line


@pytest.fixture(params=["closed port", "silent server"])
def dead_endpoint(request):
    """(endpoint, what its one line must say) of a GCS server gone away: a port nothing listens on, or one that
    accepts connections (the kernel's backlog) and never answers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        if request.param == "closed port":
            s.close()
            yield f"http://127.0.0.1:{port}", f"nothing listens on port {port} of 127.0.0.1"
        else:
            s.listen(64)
            yield f"http://127.0.0.1:{port}", f"127.0.0.1:{port} accepts connections but does not answer"


@pytest.mark.parametrize("command", ["export", "analyze"])
def test_export_and_analyze_of_a_checkpoint_whose_server_went_away_are_one_line(command, dead_endpoint, gcs,
                                                                                 tmp_path):
    """`export` and `analyze --checkpoint gs://...` with the bucket's server gone: one line naming the URL and the
    cause, within the bounded time (G2RL_JAX_STORAGE_TIMEOUT=10 here), before any model loads."""
    import subprocess
    import time

    endpoint, cause = dead_endpoint
    args = {"export": ["--out", str(tmp_path / "exported")],
            "analyze": ["--dataset", "demo", "--out", str(tmp_path / "analysis")]}[command]
    env = _emulator_env(gcs, endpoint)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", f"g2rl_jax.{command}", "--checkpoint", "gs://g2rl-test/runs/gone",
                           *args], env=env, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - t0
    line = _last_line(done)
    assert line.startswith(f"{command} error: --checkpoint: gcsfs cannot reach {endpoint} to read "
                           "gs://g2rl-test/runs/gone: ") and cause in line, line
    assert "Traceback" not in done.stderr and seconds < 60, (seconds, done.stderr[-3000:])


def _raw_upload(endpoint: str, name: str, data: bytes) -> str:
    """Another writer's media upload of gs://g2rl-test/<name> straight to `endpoint`: the new generation."""
    import urllib.parse
    import urllib.request

    url = f"{endpoint}/upload/storage/v1/b/g2rl-test/o?uploadType=media&name={urllib.parse.quote(name, safe='')}"
    with urllib.request.urlopen(urllib.request.Request(url, data=data, method="POST"), timeout=30) as answer:
        return str(json.loads(answer.read())["generation"])


def test_a_throttled_conditional_write_ends_as_its_precondition_says(gcs, monkeypatch):
    """A conditional write that draws a 429 (another writer updated the object within the second) looks at the
    object before a retry: when its precondition fails now, it ends at once as the refused write it would be (the
    starters that lose a stale lock stop contending for its one update a second); when it still holds, the write is
    retried after gcsfs's backoff and lands. Through a proxy with no faults but the rate rule."""
    import time

    from g2rl_jax.bench.gcs_proxy import Faults, GcsProxy

    name = "storage/throttled/lock"
    url, obj = gcs.url(name), f"g2rl-test/{name}"
    with GcsProxy(gcs.server, faults=Faults()) as proxy:
        for var in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"):
            monkeypatch.setenv(var, proxy.endpoint)
        first = storage.create_exclusive(url, "mine 1\n")
        time.sleep(1.05)
        _raw_upload(proxy.endpoint, name, b"theirs 1\n")
        t0 = time.monotonic()
        assert storage.replace_if_generation(url, "mine 2\n", first) is None  # the other writer's update won
        assert time.monotonic() - t0 < 0.9  # no retry after a backoff of 1 s or more
        assert [r.status for r in proxy.log if r.obj == obj and r.kind == "upload"] == [200, 200, 429]
        time.sleep(1.05)
        theirs = _raw_upload(proxy.endpoint, name, b"theirs 2\n")
        new = storage.replace_if_generation(url, "mine 3\n", theirs)  # throttled, then retried: still theirs 2
        assert new is not None and storage.read_versioned(url) == (b"mine 3\n", new)
        assert [r.status for r in proxy.log if r.obj == obj and r.kind == "upload"] == [200, 200, 429, 200, 429, 200]
