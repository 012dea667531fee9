"""Several gateways, one fleet, over a real redis-server on 127.0.0.1 (Debian's package): one
leads the controller and the batch lane by a lease in the store, the other follows the replica
set. kill -9 of the leader under streaming load through both: clients that retry on the other
gateway lose no request and get the greedy answers, the follower leads within seconds and adopts
the replicas, which stay up (the same processes); a tenant's limit holds across both gateways;
a batch running when the leader died completes with exactly one result per line. A third gateway
joins, and SIGTERM on the leader hands the fleet to it at once. Then the last gateway is killed
too, and the replicas, whose lifeline no gateway holds any more, exit."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import threading
import time

import httpx
import pytest
from openai import OpenAI

from shoal.fleet.admission.tenants import key_digest
from tests.fleet_helpers import (
    auth,
    metric,
    spawn,
    start_fleet,
    wait_replicas_ready,
    wait_until,
)

MODEL = "SmolLM2-135M-Instruct"
OPERATOR = "sk-operator"
KEYS = {"tiny": "sk-tiny", "roomy": "sk-roomy"}
LEASE_TTL_S = 2.0
LIFELINE_S = 6.0
PROMPTS = ["The colours of the rainbow are", "Once upon a time, in a small village,"]
TOKENS = 40
LINES = 12

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")


@pytest.fixture(scope="module")
def config(redis_store, tmp_path_factory):
    path = tmp_path_factory.mktemp("ha") / "fleet.toml"
    tenants = "".join(
        f'[[tenants]]\nname = "{name}"\napi_key_sha256 = "{key_digest(key)}"\n'
        f"requests_per_minute = {6 if name == 'tiny' else 6000}\nburst_s = 60\n"
        for name, key in KEYS.items()
    )
    path.write_text(
        f'[gateway]\nstore = "{redis_store}"\nstore_prefix = "ha-test:"\nlease_ttl_s = {LEASE_TTL_S}\n'
        f"replica_lifeline_s = {LIFELINE_S}\n\n{tenants}"
    )
    return str(path)


def leader(gw) -> dict:
    return httpx.get(gw.url + "/fleet/leader", timeout=5).json()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def stream(url: str, prompt: str) -> str | None:
    """A streamed greedy completion, or None if it broke off (its gateway died)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    text, done = "", False
    try:
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, headers=auth(KEYS["roomy"]), timeout=60
        ) as r:
            if r.status_code != 200:
                return None
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
    except httpx.HTTPError:
        return None
    return text if done else None


def test_the_follower_leads_when_the_leader_dies_and_nothing_is_lost(config):
    a = start_fleet(2, "--config", config, api_key=OPERATOR)
    b = spawn(
        ["fleet", "up", "--replicas", "2", "--base-port", "0", "--api-key", OPERATOR, "--config", config]
    )
    try:
        wait_replicas_ready(b, 2, api_key=OPERATOR)
        assert leader(a)["leading"] and leader(a)["gateway"] == a.url
        assert not leader(b)["leading"] and leader(b)["leader"] == a.url and leader(b)["gateways"] == 2
        pids = {r["name"]: r["pid"] for r in a.get("/replicas", headers=auth(OPERATOR)).json()["replicas"]}
        assert all(alive(p) for p in pids.values()), pids
        # A follower does not change the fleet: it says who does.
        refused = httpx.post(b.url + "/fleet/update", json={}, headers=auth(OPERATOR), timeout=10)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_leader"
        assert a.url in refused.json()["error"]["message"]

        # The tenant at 6 requests a minute gets 6 across both gateways, not 6 at each.
        codes = []
        for i in range(12):
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
            r = httpx.post(
                (a, b)[i % 2].url + "/v1/completions", json=body, headers=auth(KEYS["tiny"]), timeout=60
            )
            codes.append((i % 2, r.status_code))
        admitted = [g for g, c in codes if c == 200]
        assert 6 <= len(admitted) <= 7 and set(admitted) == {0, 1}, codes
        assert {c for _, c in codes} == {200, 429}, codes

        # Greedy references, through the follower (it routes to the leader's replicas).
        reference = {p: stream(b.url, p) for p in PROMPTS}
        assert all(len(t) > 20 for t in reference.values()), reference

        # A batch, created at the follower and run by the leader.
        client = OpenAI(base_url=b.url + "/v1", api_key=KEYS["roomy"], max_retries=0)
        rows = [
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": f"Count to {i + 3}:", "max_tokens": 24, "temperature": 0},
            }
            for i in range(LINES)
        ]
        f = client.files.create(
            file=("in.jsonl", io.BytesIO("".join(json.dumps(r) + "\n" for r in rows).encode())),
            purpose="batch",
        )
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        wait_until(b, lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, 120)
        assert client.batches.retrieve(batch.id).status == "in_progress"  # killed mid-batch

        # Streaming load through both gateways; a client whose stream breaks retries on the other.
        results: dict[int, str | None] = {}
        retried: list[int] = []

        def client_loop(k: int) -> None:
            for n in range(3):
                prompt, gw = PROMPTS[(k + n) % 2], (a, b)[(k + n) % 2]
                for attempt in range(6):
                    got = stream((gw if attempt % 2 == 0 else (b if gw is a else a)).url, prompt)
                    if got is not None:
                        break
                    retried.append(k)
                    time.sleep(0.3)
                results[k * 10 + n] = got if got == reference[prompt] else f"mismatch: {got!r}"

        threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        wait_until(a, lambda: metric(a.url, "shoal:gateway_inflight_requests") >= 1, 30, every=0.05)
        killed_at = time.monotonic()
        a.proc.kill()  # kill -9 of the leading gateway, mid-stream
        a.proc.wait(10)

        took = wait_until(b, lambda: leader(b)["leading"] and time.monotonic() - killed_at, 30)
        print(f"the follower led {took:.2f} s after the kill")
        assert took < LEASE_TTL_S + 3, took
        for t in threads:
            t.join(180)
        assert len(results) == 12 and all(v in reference.values() for v in results.values()), results
        assert retried  # streams broke off with their gateway, and were answered by the other

        # The replicas stayed up: the same processes, adopted by the new leader, ready.
        now = {r["name"]: r for r in b.get("/replicas", headers=auth(OPERATOR)).json()["replicas"]}
        assert {n: r["pid"] for n, r in now.items()} == pids, (now, pids)
        assert all(alive(p) for p in pids.values())
        assert "2 of 2 replicas adopted" in b.log()
        assert leader(b)["gateways"] == 1

        # The batch completes, with exactly one result per line.
        done = wait_until(
            b, lambda: (x := client.batches.retrieve(batch.id)).status == "completed" and x, 180
        )
        assert done.request_counts.total == LINES and done.request_counts.completed == LINES
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(r["custom_id"] for r in rows)
        assert all(o["response"]["status_code"] == 200 for o in out)

        # A third gateway joins; SIGTERM on the leader hands the fleet to it at once.
        c = spawn(
            ["fleet", "up", "--replicas", "2", "--base-port", "0", "--api-key", OPERATOR, "--config", config]
        )
        wait_replicas_ready(c, 2, api_key=OPERATOR)
        assert leader(c)["leader"] == b.url and not leader(c)["leading"]
        b.proc.send_signal(signal.SIGTERM)
        assert b.proc.wait(40) == 0
        wait_until(c, lambda: leader(c)["leading"], LEASE_TTL_S)  # released, not left to run out
        now = {r["name"]: r["pid"] for r in c.get("/replicas", headers=auth(OPERATOR)).json()["replicas"]}
        assert now == pids and all(alive(p) for p in pids.values())
        assert stream(c.url, PROMPTS[0]) == reference[PROMPTS[0]]

        # The last gateway dies too: nobody probes the replicas any more, and they exit.
        c.proc.kill()
        c.proc.wait(10)
        deadline = time.monotonic() + LIFELINE_S + 15
        while any(alive(p) for p in pids.values()):
            assert time.monotonic() < deadline, "the replicas outlived every gateway"
            time.sleep(0.2)
    finally:
        for gw in (a, b, *([c] if "c" in locals() else [])):
            gw.stop()
        for pid in pids.values() if "pids" in locals() else ():
            if alive(pid):
                os.kill(pid, 9)
