"""The fleet on Ray: a local cluster of two nodes (a head and a node joined to it, on 127.0.0.1,
started and stopped by handle here), `shoal fleet up --launcher ray`: a burst scales the model up
to a replica on each node, a replica killed is replaced, idleness scales it back down, and no
request fails; a replica gets its secrets and its thread count by environment, never argv."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile

import httpx
import pytest

from tests.fleet_helpers import metric, replicas, spawn, wait_until

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
# Ray takes 127.0.0.1 for "this machine" and advertises its other interface instead, where nothing
# listens; with this it keeps to loopback (what the launcher sets too for a loopback address).
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
NODE = {
    "num_cpus": 1,
    "node_ip_address": "127.0.0.1",
    "object_store_memory": 80 << 20,
    "include_dashboard": False,
}
REPLICA_KEY = "sk-ray-replica-7f3e21"
SALT = "ray-kv-salt-0b9c44"


@pytest.fixture(scope="module")
def cluster():
    # Its own temp dir (short: Ray's socket paths must stay short), so that nothing of another
    # Ray on this machine is touched.
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    saved = {k: os.environ.get(k) for k in (*LOOPBACK, "RAY_TMPDIR")}
    os.environ.update({**LOOPBACK, "RAY_TMPDIR": temp})
    c = Cluster(initialize_head=True, head_node_args=NODE)
    try:
        c.add_node(**NODE)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()  # by handle: never `ray stop`, which would end every Ray process here
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet(cluster):
    args = ["fleet", "up", "--launcher", "ray", "--address", cluster.address, "--min-replicas", "1"]
    args += ["--max-replicas", "2", "--target-inflight", "2", "--scale-up-delay", "0.3"]
    args += ["--scale-down-delay", "15", "--replica-args", "--threads 1 --kv-cache-memory 256MiB"]
    args += ["--replica-api-key", REPLICA_KEY]  # what the gateway sends them; its clients send none
    gw = spawn(args, env={"SHOAL_KV_SALT": SALT})
    try:
        wait_until(gw, lambda: ready(gw) == 1, 240)
        yield gw
    finally:
        gw.stop()


def ready(gw) -> int:
    return sum(r["lifecycle"] == "ready" and r["state"] == "ready" for r in replicas(gw).values())


async def burst(url: str, n: int, max_tokens: int = 64) -> list[int]:
    async with httpx.AsyncClient(timeout=240) as c:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True}
        answers = await asyncio.gather(*(c.post(url + "/v1/completions", json=body) for _ in range(n)))
    return [a.status_code if a.status_code == 200 else (a.status_code, a.text[:300]) for a in answers]


def test_a_replica_gets_its_secrets_and_threads_by_environment(fleet):
    (r,) = replicas(fleet).values()
    with open(f"/proc/{r['pid']}/cmdline", "rb") as f:
        argv = f.read()
    with open(f"/proc/{r['pid']}/environ", "rb") as f:
        env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    assert REPLICA_KEY.encode() not in argv and SALT.encode() not in argv, argv
    assert (env[b"SHOAL_API_KEY"], env[b"SHOAL_KV_SALT"]) == (REPLICA_KEY.encode(), SALT.encode())
    assert env[b"OMP_NUM_THREADS"] == b"1"  # the CPUs its placement reserved
    assert httpx.get(r["url"] + "/v1/models", timeout=10).status_code == 401  # and it wants the key


def test_scale_up_onto_both_nodes_replace_a_killed_replica_and_scale_down(fleet, cluster):
    assert asyncio.run(burst(fleet.url, 8, max_tokens=160)) == [200] * 8
    wait_until(fleet, lambda: ready(fleet) == 2, 10)  # scaled up during the burst, not down yet
    nodes = {r["node"] for r in replicas(fleet).values()}
    assert len(nodes) == 2 and None not in nodes  # one replica on each node of the cluster

    victim = next(iter(replicas(fleet).values()))
    os.kill(victim["pid"], signal.SIGKILL)

    async def load_through_the_kill():
        return await burst(fleet.url, 6, max_tokens=32)

    assert asyncio.run(load_through_the_kill()) == [200] * 6
    wait_until(fleet, lambda: replicas(fleet)[victim["name"]]["pid"] not in (None, victim["pid"]), 120)
    assert replicas(fleet)[victim["name"]]["restarts"] >= 1

    # Idle: back to the one replica min_replicas keeps, through draining.
    wait_until(fleet, lambda: len(replicas(fleet)) == 1 and ready(fleet) == 1, 120)
    assert metric(fleet.url, 'shoal:gateway_responses_total{status="503"}') == 0
