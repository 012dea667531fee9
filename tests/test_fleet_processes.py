"""The processes a real local fleet starts, read from /proc: no secret in the arguments of any of
them (the API key, the KV salt, the K/V transfer key and the tensor-parallel ranks' key travel by
environment, which other users cannot read), and each replica pinned to its own share of the
host's cores with as many compute threads, its tensor-parallel ranks inside that share."""

from __future__ import annotations

import os

import httpx
import pytest

from shoal.fleet.control.cores import host_cpus
from shoal.protocol.secrets import API_KEY_ENV, KV_SALT_ENV, KV_TRANSFER_KEY_ENV
from tests.fleet_helpers import auth, spawn, wait_replicas_ready

KEY = "sk-fleet-operator-5d1f0c2a"
SALT = "kv-salt-secret-93be7d"
TRANSFER_KEY = "kv-transfer-secret-4c81aa"
FLEET = """
[[models]]
name = "tp"
replica_args = ["--tensor-parallel-size", "2", "--kv-cache-memory", "64MiB"]

[[models]]
name = "one"
replica_args = ["--kv-cache-memory", "64MiB"]
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    path = tmp_path_factory.mktemp("fleet") / "fleet.toml"
    path.write_text(FLEET)
    env = {API_KEY_ENV: KEY, KV_SALT_ENV: SALT, KV_TRANSFER_KEY_ENV: TRANSFER_KEY}
    gw = spawn(["fleet", "up", "--config", str(path), "--base-port", "0"], env)
    gw.api_key = KEY
    try:
        wait_replicas_ready(gw, 2, api_key=KEY)
        yield gw
    finally:
        gw.stop()


def _read(pid: int, what: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read()
    except OSError:  # it exited meanwhile
        return b""


def descendants(root: int) -> list[int]:
    """Every live process below `root`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(int(entry), "stat")
            if stat:
                ppid = int(stat.rsplit(b")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def environ(pid: int) -> dict[str, str]:
    pairs = (e.split(b"=", 1) for e in _read(pid, "environ").split(b"\0") if b"=" in e)
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def processes(gw) -> dict[str, list[int]]:
    """The fleet's processes by kind: serve (replicas) and rank (tensor-parallel ranks)."""
    kinds: dict[str, list[int]] = {"serve": [], "rank": []}
    for pid in descendants(gw.proc.pid):
        cmd = _read(pid, "cmdline")
        if b"shoal.cli\0serve" in cmd:
            kinds["serve"].append(pid)
        elif b"shoal.engine.parallel.worker" in cmd:
            kinds["rank"].append(pid)
    return kinds


def test_no_secret_is_in_any_process_arguments(fleet):
    procs = processes(fleet)
    assert len(procs["serve"]) == 2 and len(procs["rank"]) == 2, procs
    rank_key = environ(procs["rank"][0])["SHOAL_WORKER_AUTHKEY"]
    assert len(rank_key) >= 32
    secrets = {"api key": KEY, "kv salt": SALT, "transfer key": TRANSFER_KEY, "rank key": rank_key}
    for pid in [fleet.proc.pid, *descendants(fleet.proc.pid)]:
        argv = _read(pid, "cmdline").decode(errors="replace").replace("\0", " ")
        leaked = [name for name, s in secrets.items() if s in argv]
        assert not leaked, f"{leaked} in the arguments of {pid}: {argv}"
    for pid in procs["serve"]:  # what they got instead
        env = environ(pid)
        assert (env[API_KEY_ENV], env[KV_SALT_ENV], env[KV_TRANSFER_KEY_ENV]) == (KEY, SALT, TRANSFER_KEY)


def test_the_replicas_still_enforce_the_key(fleet):
    reps = fleet.get("/replicas").json()["replicas"]
    assert len(reps) == 2
    for r in reps:
        assert httpx.get(r["url"] + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(r["url"] + "/v1/models", headers=auth("wrong"), timeout=10).status_code == 401
        assert httpx.get(r["url"] + "/v1/models", headers=auth(KEY), timeout=10).status_code == 200
    body = {"prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True}
    assert fleet.post("/v1/completions", json={**body, "model": "one"}).status_code == 401
    for model in ("tp", "one"):
        resp = fleet.post("/v1/completions", json={**body, "model": model}, headers=auth(KEY))
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4


def test_each_replica_runs_on_its_own_cores(fleet):
    pools = fleet.get("/replicas").json()["pools"]
    cores = {name: cpus for p in pools for name, cpus in p["cores"].items()}
    share = max(1, len(host_cpus()) // 2)  # two replicas may run at once
    assert sorted(map(len, cores.values())) == [share, share], cores
    assert not set(cores["tp-0"]) & set(cores["one-1"])
    by_port = {r["url"].rsplit(":", 1)[1]: r["name"] for r in fleet.get("/replicas").json()["replicas"]}
    procs = processes(fleet)
    for pid in procs["serve"]:
        argv = _read(pid, "cmdline").split(b"\0")
        name = by_port[argv[argv.index(b"--port") + 1].decode()]
        assert sorted(os.sched_getaffinity(pid)) == cores[name]
        assert environ(pid)["OMP_NUM_THREADS"] == str(share)  # torch and the C kernels' OpenMP
    for pid in procs["rank"]:  # a tensor-parallel replica's ranks stay on its cores
        assert sorted(os.sched_getaffinity(pid)) == cores["tp-0"]
