"""Copies of a bucket's model directory in the local cache (storage.local_copy) are content-addressed and land whole
by an atomic rename: processes that copy the same objects at the same moment share one copy, and none deletes a copy
another may be reading. Real processes on a real GCS server on loopback (fake-gcs-server)."""
import os
import subprocess
import sys

from test_train import _env

from g2rl_jax import storage

COPY = ("import os, sys, time\n"
        "from g2rl_jax import storage\n"
        "print('ready', flush=True)\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.001)\n"
        "where = storage.local_copy(sys.argv[1], 'model.path')\n"
        "names = sorted(os.listdir(where))\n"
        "data = {n: open(os.path.join(where, n), 'rb').read() for n in names if not n.startswith('.')}\n"
        "ok = data == {'config.json': b'{}', 'model.safetensors': bytes(range(256)) * 4000}\n"
        "print(where, ok, flush=True)\n")


def test_processes_copying_at_once_share_one_whole_copy(gcs, tmp_path, monkeypatch):
    url = gcs.url("models/shared")
    storage.write_text(f"{url}/config.json", "{}")
    storage.write_bytes(f"{url}/model.safetensors", bytes(range(256)) * 4000)
    env = dict(_env(), **{storage.CACHE_ENV: str(tmp_path / "cache")})
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", COPY, url, str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready"] * 3
        go.touch()
        said = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in said]
    wheres = {out.split()[0] for out, _ in said}
    assert len(wheres) == 1 and all(out.split()[1] == "True" for out, _ in said), said
    copies = tmp_path / "cache" / "copies"
    assert os.listdir(copies) == [os.path.basename(wheres.pop())]  # no temporary directory left behind

    storage.write_text(f"{url}/config.json", '{"v": 2}')  # a new version of one object: another directory
    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    second = storage.local_copy(url, "model.path")
    assert len(os.listdir(copies)) == 2 and open(os.path.join(second, "config.json")).read() == '{"v": 2}'
