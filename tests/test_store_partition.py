"""The store on a test host of its own (a network namespace, shoal.testing.hosts), its link cut
under a gateway that shares tenants' limits through it: a store that answers nothing (no reset,
no refusal) costs the first request at most the store's timeout, and the requests after it none;
once the link is back, the gateway uses the store again."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time

import httpx
import pytest

from shoal.fleet.admission.tenants import key_digest
from tests.cross_host_helpers import host_cluster
from tests.fleet_helpers import auth, start_gateway, wait_until

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-limited"
REDIS_PORT = 6390
PASSWORD = "store-partition-test"  # a store other hosts reach needs one (redis' protected mode)
# The gateway's store_timeout_s: a request that waited for the store took at least this long, far
# more than a loaded host's stalls (2.1 s here, 4 busy loops on 2 cores).
TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def store_host():
    """h0 runs redis-server on its own address; yields (host, store URL)."""
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server")
    with host_cluster(1) as cluster:
        host = cluster.hosts[0]
        argv = ["redis-server", "--port", str(REDIS_PORT), "--bind", host.address, "--requirepass", PASSWORD]
        argv += ["--save", "", "--appendonly", "no"]
        host.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while stored_keys(host.address, "*") is None:
            assert time.monotonic() < deadline, "redis-server on h0 did not start"
            time.sleep(0.05)
        yield host, f"redis://:{PASSWORD}@{host.address}:{REDIS_PORT}/0"


def cli(address: str, *command: str) -> list[str] | None:
    """redis-cli's answer to `command` from here, word by word (None: no answer within 2 s)."""
    argv = ["redis-cli", "-h", address, "-p", str(REDIS_PORT), "-a", PASSWORD, "--no-auth-warning", "--raw"]
    try:
        done = subprocess.run([*argv, *command], capture_output=True, text=True, timeout=2)
    except subprocess.TimeoutExpired:
        return None
    refused = done.returncode or done.stdout.startswith(("ERR", "DENIED", "NOAUTH"))
    return None if refused else done.stdout.split()


def stored_keys(address: str, pattern: str) -> list[str] | None:
    """The store's keys matching `pattern` (None: it did not answer)."""
    return cli(address, "keys", pattern)


def ask(gw) -> tuple[int, float]:
    """One short completion of the limited tenant's: its status and how long it took."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    started = time.monotonic()
    r = httpx.post(gw.url + "/v1/completions", json=body, headers=auth(KEY), timeout=60)
    return r.status_code, time.monotonic() - started


def bucket_stamp(address: str) -> float:
    """When the store last drew from (or refilled) the tenant's shared bucket, by its clock."""
    return float(cli(address, "hget", "shoal:tenant:limited:requests", "stamp")[0])


def test_a_store_behind_a_cut_link_holds_no_request_past_its_timeout(store_host, chat_server, tmp_path):
    host, url = store_host
    config = tmp_path / "gw.toml"
    config.write_text(
        f"[gateway]\nstore_timeout_s = {TIMEOUT_S}\n\n"
        f'[[tenants]]\nname = "limited"\napi_key_sha256 = "{key_digest(KEY)}"\n'
        "requests_per_minute = 60\nburst_s = 60\nmax_concurrency = 4\n"
    )
    gw = start_gateway([chat_server.url], "--config", str(config), "--store", url)
    try:
        before = [ask(gw) for _ in range(5)]
        assert all(status == 200 for status, _ in before), before
        usual = statistics.median(took for _, took in before)
        # Both shared limits were kept in the store: the tenant's bucket and its places.
        assert stored_keys(host.address, "shoal:tenant:limited:*") == ["shoal:tenant:limited:requests"]
        assert stored_keys(host.address, "shoal:concurrency:limited") == ["shoal:concurrency:limited"]

        host.cut()  # packets to it are dropped: its commands time out, none is refused
        try:
            cut = [ask(gw) for _ in range(12)]
        finally:
            host.restore()
        assert all(status == 200 for status, _ in cut), cut
        # The first waits for the store once at most (its places; its bucket is not asked then),
        # or not at all after a beat that failed; after it, the store is left alone.
        assert cut[0][1] < usual + TIMEOUT_S + 1.0, (usual, cut)
        assert max(took for _, took in cut[1:]) < TIMEOUT_S, (usual, cut)
        log = gw.log()
        assert log.count("admitting on this gateway's own") == 1, log[-3000:]  # said once, not a request

        # Back: the beat finds the store within a second or two, and admission uses it again.
        wait_until(gw, lambda: "answers again" in gw.log(), 15)
        drawn = bucket_stamp(host.address)
        assert [ask(gw)[0] for _ in range(3)] == [200] * 3
        assert bucket_stamp(host.address) > drawn  # drawn from the shared bucket again
    finally:
        gw.stop()
