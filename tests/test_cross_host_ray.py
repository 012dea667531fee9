"""The fleet on a Ray cluster whose nodes are hosts of their own (shoal.testing.hosts): the Ray head
on one host, a worker on another, the gateway (`shoal fleet up --launcher ray`) on a third, a node
without CPUs; a fourth joins later as spare room. Replicas land on both CPU hosts; KV-aware routing
sends a shared prefix back to the host that holds it; a worker host killed under streaming load
loses no stream, and the launcher starts its replica again on the spare host."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shoal.testing.hosts import Host
from tests.cross_host_helpers import (
    assert_streams_exact,
    expected_on,
    host_cluster,
    stream_bodies,
    streams_with_fault,
    wait_idle,
)
from tests.fleet_helpers import auth, metric, replicas
from tests.server_helpers import ServerProcess

pytest.importorskip("ray")

MODEL = "SmolLM2-135M-Instruct"
HEAD, WORKER, GATEWAY, SPARE = 0, 1, 2, 3
RAY_PORT, GATEWAY_PORT = 6379, 8080
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
NODE_ARGS = ("--object-store-memory=80000000", "--disable-usage-stats")
KEY = "ray-fleet-test-key"  # the gateway's, and the one it gives its replicas
HEADERS = auth(KEY)
LONG_PREFIX = " ".join(f"Fact {i}: the river bends near stone {i * 7}." for i in range(14))


@pytest.fixture(scope="module")
def cluster():
    with host_cluster(4) as c:
        yield c


def ray_node(host: Host, head: Host, cpus: int) -> None:
    """A Ray node on `host` (the head when host is head), its state in the host's own /tmp.
    It ends with the cluster's hosts (their processes are killed by handle: never `ray stop`)."""
    where = (
        ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        if host is head
        else [f"--address={head.address}:{RAY_PORT}"]
    )
    host.check_output(
        [RAY, "start", *where, f"--node-ip-address={host.address}", f"--num-cpus={cpus}", *NODE_ARGS],
        timeout=180,
    )


@pytest.fixture(scope="module")
def fleet(cluster):
    """The gateway on GATEWAY (a CPU-less Ray node), two replicas placed by Ray."""
    hosts = cluster.hosts
    ray_node(hosts[HEAD], hosts[HEAD], 1)
    with ThreadPoolExecutor(2) as pool:  # the other nodes join at once
        list(pool.map(ray_node, (hosts[WORKER], hosts[GATEWAY]), (hosts[HEAD],) * 2, (1, 0)))
    gw_host = hosts[GATEWAY]
    fd, log_path = tempfile.mkstemp(prefix="shoal-ray-gw-", suffix=".log")
    args = ["fleet", "up", "--launcher", "ray", "--address", f"{hosts[HEAD].address}:{RAY_PORT}"]
    args += ["--replicas", "2", "--host", gw_host.address, "--port", str(GATEWAY_PORT)]
    args += ["--replica-args", "--threads 1 --kv-cache-memory 256MiB"]
    with os.fdopen(fd, "w") as log:
        proc = gw_host.run(
            [sys.executable, "-m", "shoal.cli", *args],
            env={**os.environ, "PYTHONUNBUFFERED": "1", "SHOAL_API_KEY": KEY},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    gw = ServerProcess(f"http://{gw_host.address}:{GATEWAY_PORT}", proc, log_path)
    try:
        wait_ready(gw, 2, 300)
        yield gw
    finally:
        gw.stop()


def ready_replicas(gw: ServerProcess) -> dict[str, dict]:
    return {n: r for n, r in replicas(gw, KEY).items() if r["state"] == "ready" and r["lifecycle"] == "ready"}


def wait_ready(gw: ServerProcess, count: int, timeout: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        if gw.proc.poll() is not None:
            raise RuntimeError(f"the gateway exited: {gw.log()[-3000:]}")
        try:
            ready = ready_replicas(gw)
            if len(ready) >= count:
                return ready
        except (httpx.HTTPError, KeyError):
            pass
        assert time.monotonic() < deadline, f"{count} replicas not ready: {gw.log()[-3000:]}"
        time.sleep(0.5)


def host_of(url: str) -> str:
    return url.split("//", 1)[1].rsplit(":", 1)[0]


def test_replicas_land_on_both_cpu_hosts_and_shared_prefixes_go_home(cluster, fleet):
    reps = ready_replicas(fleet)
    assert {host_of(r["url"]) for r in reps.values()} == {
        cluster.hosts[HEAD].address,
        cluster.hosts[WORKER].address,
    }
    # Each document's first request straight to a replica of either host: the gateway learns where
    # its blocks are only from the replicas' KV events.
    names = sorted(reps)
    homes = {k: names[k % 2] for k in range(4)}
    for k, name in homes.items():
        body = {"model": MODEL, "prompt": f"Document {k}. {LONG_PREFIX} Question one?", "max_tokens": 1}
        r = httpx.post(reps[name]["url"] + "/v1/completions", json=body, headers=HEADERS, timeout=120)
        assert r.status_code == 200, r.text
    # The gateway polls the replicas' KV events: wait until its index has the prompts' blocks.
    deadline = time.monotonic() + 20
    while sum(r["cached_blocks"] for r in replicas(fleet, KEY).values()) < 40 and time.monotonic() < deadline:
        time.sleep(0.1)
    for k in range(4):
        for r in replicas(fleet, KEY).values():
            wait_idle(r["url"], headers=HEADERS)
        home = reps[homes[k]]["url"]
        hits = metric(home, "shoal:prefix_cache_hits_total")
        body = {"model": MODEL, "prompt": f"Document {k}. {LONG_PREFIX} Another question?", "max_tokens": 1}
        r = httpx.post(fleet.url + "/v1/completions", json=body, headers=HEADERS, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-replica"] == homes[k], (k, homes)
        assert metric(home, "shoal:prefix_cache_hits_total") - hits >= 160  # its prefix was reused


def test_a_worker_host_killed_under_streaming_load_loses_nothing_and_its_replica_moves(cluster, fleet):
    hosts = cluster.hosts
    ray_node(hosts[SPARE], hosts[HEAD], 1)  # room for the replica the kill will take
    reps = ready_replicas(fleet)
    victim = next(n for n, r in reps.items() if host_of(r["url"]) == hosts[WORKER].address)
    survivor = next(r for n, r in reps.items() if n != victim)
    bodies = stream_bodies(5000, 96)
    expected = expected_on(survivor["url"], bodies, HEADERS)
    wait_idle(survivor["url"], headers=HEADERS)

    async def kill() -> None:
        await asyncio.to_thread(hosts[WORKER].kill)

    outs, _ = streams_with_fault(fleet.url, bodies, kill, headers=HEADERS)
    assert any(o["replica"] == victim for o in outs)  # some streams were on the killed host
    assert_streams_exact(outs, bodies, expected)
    # The launcher starts the lost replica again, on the host with room.
    deadline = time.monotonic() + 240
    while True:
        ready = ready_replicas(fleet)
        where = {host_of(r["url"]) for r in ready.values()}
        if len(ready) == 2 and hosts[SPARE].address in where:
            break
        assert time.monotonic() < deadline, (replicas(fleet, KEY), fleet.log()[-3000:])
        time.sleep(0.5)
    assert hosts[WORKER].address not in where
    for r in ready.values():
        wait_idle(r["url"], headers=HEADERS)
