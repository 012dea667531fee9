"""The store on a test host of its own (a network namespace, shoal.testing.hosts), its link cut
under a gateway that shares tenants' limits and batch jobs through it: a store that answers
nothing (no reset, no refusal) costs the first request at most the store's timeout, and the
requests after it none; the batch API answers 503 at once and holds no thread the gateway's
requests need; once the link is back, the gateway uses the store again and the batch that ran
through the cut ends with each line's result once."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import statistics
import subprocess
import time

import httpx
import pytest

from shoal.fleet.admission.tenants import key_digest
from tests.cross_host_helpers import host_cluster
from tests.fleet_helpers import auth, start_gateway, wait_until
from tests.test_batch_api import jsonl

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


BATCH_TIMEOUT_S = 3.0  # the gateway's batch_store_timeout_s in the test below
LINES = 12


def batch_lines() -> bytes:
    rows = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Count to {i}"}],
                "max_tokens": 24,
            },
        }
        for i in range(LINES)
    ]
    return jsonl(rows)


def big_chat(gw) -> tuple[int, float]:
    """A chat request of more than 64 KiB (JSON whitespace): the gateway parses it on a thread of
    asyncio's default pool. Its status and how long it took."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    padded = body[:-1] + " " * (96 << 10) + "}"
    started = time.monotonic()
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        content=padded,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    return r.status_code, time.monotonic() - started


def test_a_cut_store_fails_the_batch_api_fast_and_the_batch_ends_with_each_line_once(
    store_host, chat_server, tmp_path
):
    host, url = store_host
    config = tmp_path / "gw.toml"
    config.write_text(f"[gateway]\nbatch_store_timeout_s = {BATCH_TIMEOUT_S}\nstore_prefix = 'cut:'\n")
    gw = start_gateway([chat_server.url], "--config", str(config), "--store", url)
    api = httpx.Client(base_url=gw.url, timeout=60)
    try:
        up = api.post("/v1/files", files={"file": ("in.jsonl", batch_lines())}, data={"purpose": "batch"})
        assert up.status_code == 200, up.text
        ask = {
            "input_file_id": up.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        batch = api.post("/v1/batches", json=ask).json()
        wait_until(
            gw, lambda: api.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] >= 1, 120
        )

        host.cut()
        try:
            # More batch calls at once than asyncio's default pool has threads (6 on 2 cores),
            # and large requests beside them: those are parsed on that pool.
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                started = time.monotonic()
                calls = [pool.submit(api.get, f"/v1/batches/{batch['id']}") for _ in range(10)]
                time.sleep(0.5)
                chats = [big_chat(gw) for _ in range(3)]
                answered = [c.result() for c in calls]
                took = time.monotonic() - started
            late = api.get("/v1/files")  # the store is known away: no wait at all
        finally:
            host.restore()
        assert all(status == 200 for status, _ in chats), chats
        assert max(t for _, t in chats) < BATCH_TIMEOUT_S, chats  # not behind a batch call's wait
        assert {r.status_code for r in answered} == {503}, [r.text for r in answered]
        assert {r.json()["error"]["code"] for r in answered} == {"store_unavailable"}
        assert took < BATCH_TIMEOUT_S + 3.0, took
        assert late.status_code == 503 and late.elapsed.total_seconds() < 1.0, late

        # Back: the API answers again, and the batch ends with every line's result, each once.
        wait_until(gw, lambda: api.get("/v1/files").status_code == 200, 15)
        wait_until(gw, lambda: api.get(f"/v1/batches/{batch['id']}").json()["status"] == "completed", 180)
        done = api.get(f"/v1/batches/{batch['id']}").json()
        assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}, done
        out = api.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()
        ids = sorted(json.loads(line)["custom_id"] for line in out)
        assert ids == sorted(f"line-{i}" for i in range(LINES))
        assert gw.log().count("did not answer") == 1, gw.log()[-3000:]  # said once, not per call
    finally:
        api.close()
        gw.stop()
