"""Faults under streaming load on a fleet across hosts made of network namespaces: a replica host
partitioned, the host of one tensor-parallel rank cut off mid-step, then a replica host killed
whole: every stream ends token for token as it would have without the fault. The host kill comes
last: that host is gone for the rest of the module."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shoal.engine.parallel.worker import AUTHKEY_ENV
from shoal.protocol.errors import EXIT_RANK_LOST, RANK_LOST_CODE
from tests.cross_host_helpers import (
    COMMON_ARGS,
    DOWN_BOUND_S,
    FAULT_AFTER,
    MODEL,
    STREAMS,
    assert_streams_exact,
    expected_on,
    finished,
    gateway,
    host_cluster,
    less,
    on_host,
    reasons,
    serve,
    state,
    stop_all,
    stream_bodies,
    streams_with_fault,
    wait_idle,
    wait_ready,
    wait_state,
)
from tests.fleet_helpers import metric
from tests.server_helpers import ServerProcess

# Long enough that every stream is midway when the fault comes, and (partition) still runs on the
# cut-off replica when its link comes back.
PARTITION_TOKENS = 256
# The tensor-parallel replica: its driver and rank 0 on h0, rank 1 on h2 (whose link is cut).
TP_PORT, TP_DIST_PORT = 8200, 29600
RANK_TIMEOUT_S = 3.0
# Through the gateway; one more streams from the replica directly. Enough tokens that the stream
# on the plain replica still runs when the split one's, slowed by gloo across hosts, reach
# FAULT_AFTER (on an AMD EPYC, 64 were done first).
TP_STREAMS, TP_TOKENS = 2, 192
TP_ARGS = (*COMMON_ARGS, "--quantization", "none")

FLEET_PORT = 8100
PARTITIONED = KILLED = 1  # the host cut off, later killed; the replica on each is backend-<host>
PARTITION_EVIDENCE: dict = {}  # what the partitioned replica did, for the (xfail) check after


@pytest.fixture(scope="module")
def cluster():
    with host_cluster(3) as c:
        yield c


# --- processes -------------------------------------------------------------------------------


def test_the_host_of_one_tensor_parallel_rank_cut_off_mid_step(cluster, tmp_path):
    """A `-tp 2 --external-workers` replica, its driver and rank 0 on h0 and rank 1 on h2, beside
    a plain replica on h1, behind a gateway. h2's link cut mid-stream: rank 1 misses the step, the
    driver gives it up after --rank-timeout, its requests end with `rank_lost` and it exits with
    EXIT_RANK_LOST; the gateway continues its streams on h1, token for token. Its ranks end too:
    rank 0 once the driver is gone, rank 1 once its link is back and it hears so. Both replicas
    unquantized: split or whole, the same fp32 model (int4 kernels split across ranks sum in
    another order, enough to sample another token now and then)."""
    h0, h1, h2 = cluster.hosts
    auth = {AUTHKEY_ENV: secrets.token_hex(16)}
    split = ("-tp", "2", "--external-workers", "--distributed-host", h0.address)
    split += ("--distributed-port", str(TP_DIST_PORT), "--rank-timeout", str(RANK_TIMEOUT_S))
    worker = [sys.executable, "-m", "shoal.cli", "worker", "--driver", f"{h0.address}:{TP_DIST_PORT}"]
    bodies = stream_bodies(5000, TP_TOKENS)
    on_gw, direct = bodies[:TP_STREAMS], bodies[TP_STREAMS]
    plain, tp, gw, ranks, seen = None, None, None, [], {}
    t0 = time.monotonic()
    try:
        plain = serve(h1, TP_PORT + 1, *TP_ARGS)
        tp = serve(h0, TP_PORT, *split, *TP_ARGS, env=auth)
        for rank, host in enumerate((h0, h2)):
            with open(tmp_path / f"rank{rank}.log", "w") as log:
                argv = [*worker, "--rank", str(rank)]
                ranks.append(host.run(argv, env={**os.environ, **auth}, stdout=log, stderr=subprocess.STDOUT))
        wait_ready([plain])
        with ThreadPoolExecutor(1) as pool:  # the gateway starts while the ranks load, and waits
            expecting = pool.submit(expected_on, plain.url, on_gw)
            try:
                gw = gateway([tp.url, plain.url], tmp_path, "tp", policy="round_robin")
            except RuntimeError:
                wait_ready([tp], timeout=1)  # if it did not come up: with its log
                raise
            seen["up_s"] = time.monotonic() - t0
            expected = expecting.result(timeout=120)
        wait_idle(plain.url)
        done = finished(plain.url)
        t_streams = time.monotonic()

        async def partition() -> None:
            t_cut = time.monotonic()
            await asyncio.to_thread(h2.cut)
            seen["exit"] = await asyncio.to_thread(tp.proc.wait, RANK_TIMEOUT_S + 20)
            seen["exit_after_s"] = time.monotonic() - t_cut
            seen["rank0"] = await asyncio.to_thread(ranks[0].wait, RANK_TIMEOUT_S + 20)
            seen["rank0_after_s"] = time.monotonic() - t_cut

        outs, _ = streams_with_fault(gw.url, on_gw, partition, direct=((tp.url, direct),))
        outs, mine = outs[:-1], outs[-1]
        seen["streams_s"] = time.monotonic() - t_streams
        # Rank 1 cannot hear that its driver is gone while its host is cut off.
        seen["rank1_while_cut"] = ranks[1].poll()
        t_restore = time.monotonic()
        h2.restore()
        try:
            seen["rank1"] = ranks[1].wait(30)
        except subprocess.TimeoutExpired:
            seen["rank1"] = None
        seen["rank1_after_restore_s"] = time.monotonic() - t_restore
        print(f"tp rank cut off: {seen}")
        moved = [i for i, o in enumerate(outs) if o["replica"] == "backend-0"]
        assert moved and len(moved) < len(on_gw), [o["replica"] for o in outs]
        # What the replica's requests ended with: asked directly, the in-band error itself.
        assert [e["error"]["code"] for e in mine["errors"]] == [RANK_LOST_CODE], mine["errors"]
        assert FAULT_AFTER <= len(mine["ids"]) < TP_TOKENS and not mine["finish"], mine
        assert_streams_exact(outs, on_gw, expected)
        # The gateway heard the same of each stream there, and continued it on h1.
        broke = [line for line in gw.log().splitlines() if "stream from backend-0 broke" in line]
        assert len(broke) == len(moved), broke
        assert all("the engine loop stopped while the request ran" in line for line in broke), broke
        assert metric(gw.url, "shoal:gateway_failovers_total") == len(moved)
        assert less(finished(plain.url), done) == {"length": len(on_gw)}
        assert seen["exit"] == EXIT_RANK_LOST, tp.log()[-3000:]
        assert seen["exit_after_s"] < RANK_TIMEOUT_S + 15, seen
        assert seen["rank0"] == 0 and seen["rank0_after_s"] < RANK_TIMEOUT_S + 20, seen
        assert seen["rank1_while_cut"] is None, seen
        assert seen["rank1"] == 0, f"rank 1: {seen}"
        wait_state(gw, "backend-0", "down", DOWN_BOUND_S)
        wait_idle(plain.url)
    finally:
        h2.restore()
        stop_all([s for s in (gw, tp, plain) if s is not None])
        for p in ranks:
            p.kill()
            p.wait()


@pytest.fixture(scope="class")
def fleet(cluster, tmp_path_factory):
    reps: list[ServerProcess] = []
    gw = None
    try:
        reps = [serve(cluster.hosts[h], FLEET_PORT, *COMMON_ARGS) for h in (0, 1)]
        wait_ready(reps)
        tmp = tmp_path_factory.mktemp("fleet")
        gw = gateway([r.url for r in reps], tmp, "fleet", policy="round_robin")
        yield gw, reps
    finally:
        stop_all([gw] if gw else [])
        stop_all(reps)


@pytest.fixture(scope="class")
def expected(fleet):
    """expected_on, asked of a replica once for the same requests: the partition restored while
    the replica runs them and the host kill stream the same bodies from the same survivor."""
    answers = {}

    def on(url: str, bodies: list[dict]) -> list[list[int]]:
        key = (url, json.dumps(bodies, sort_keys=True))
        if key not in answers:
            answers[key] = expected_on(url, bodies)
        return answers[key]

    return on


class TestReplicaHostFaults:
    """Two replicas of the bundled model (its own int4 weights), on h0 and h1, behind a gateway
    here that spreads requests round robin. The partition comes first; the kill of h0 last."""

    @pytest.mark.parametrize("restore", ["while_it_runs_them", "after_it_gave_them_up"])
    def test_a_partitioned_replica_is_marked_down_its_streams_continue_and_it_comes_back(
        self, cluster, fleet, expected, restore
    ):
        """The link of h1 cut mid-stream; restored either while the replica still runs the
        requests the gateway moved away, or once it gave them up: its connections' unacknowledged
        data past --peer-timeout (5 s) tells it that its client is gone, well before 256 tokens."""
        gw, reps = fleet
        host, cut, other = cluster.hosts[PARTITIONED], reps[PARTITIONED], reps[1 - PARTITIONED]
        name = f"backend-{PARTITIONED}"
        bodies = stream_bodies(1000 if restore == "while_it_runs_them" else 3000, PARTITION_TOKENS)
        answers = expected(other.url, bodies)
        for r in reps:
            wait_idle(r.url)
        done_cut, done_other = finished(cut.url), finished(other.url)
        failovers = metric(gw.url, "shoal:gateway_failovers_total")

        def inside(path: str) -> str:  # the cut-off replica, asked from its own host
            return on_host(host, cut.url + path)

        async def partition() -> dict:
            seen = {}
            t_cut = time.monotonic()
            try:
                await asyncio.to_thread(host.cut)
                while (now := await asyncio.to_thread(state, gw, name)) != "down":
                    assert time.monotonic() - t_cut < DOWN_BOUND_S, f"{name} still {now}"
                    await asyncio.sleep(0.05)
                seen["down_after_s"] = time.monotonic() - t_cut
                seen["running_when_down"] = json.loads(await asyncio.to_thread(inside, "/load"))["running"]
                # Its streams go on elsewhere now, and it goes on with them too.
                if restore == "while_it_runs_them":
                    await asyncio.sleep(0.2)
                else:
                    while json.loads(await asyncio.to_thread(inside, "/load"))["running"]:
                        assert time.monotonic() - t_cut < 60, "the cut-off replica never stopped"
                        await asyncio.sleep(0.2)
                seen["running_at_restore"] = json.loads(await asyncio.to_thread(inside, "/load"))["running"]
                seen["finished_while_cut"] = less(
                    reasons(await asyncio.to_thread(inside, "/metrics")), done_cut
                )
            finally:
                await asyncio.to_thread(host.restore)
            return seen

        try:
            outs, seen = streams_with_fault(gw.url, bodies, partition)
        finally:
            host.restore()  # whatever failed: the later tests need the link
        moved = [i for i, o in enumerate(outs) if o["replica"] == name]
        assert moved and len(moved) < STREAMS, [o["replica"] for o in outs]
        assert_streams_exact(outs, bodies, answers)
        assert seen["down_after_s"] < DOWN_BOUND_S
        assert metric(gw.url, "shoal:gateway_failovers_total") - failovers == len(moved)
        # The survivor ran each of its own streams and each moved one's continuation, once.
        assert less(finished(other.url), done_other) == {"length": STREAMS}
        # The gateway gave up on requests the cut-off replica was still running.
        assert seen["running_when_down"] == len(moved), seen
        # Back: ready again, then idle, and it takes traffic.
        seen["back_after_s"] = wait_state(gw, name, "ready", 30)
        for r in reps:
            wait_idle(r.url, timeout=60)
        seen.update(moved=len(moved), finished_there=less(finished(cut.url), done_cut))
        PARTITION_EVIDENCE[restore] = seen
        print(f"partition, restored {restore}: {seen}")
        # Its client gone (the gateway's side of each stream closed, seen once the link is back;
        # or its unacknowledged data past the peer timeout while cut off), it aborts each moved
        # request: none runs twice to completion.
        if restore == "while_it_runs_them":
            assert seen["running_at_restore"] == len(moved), seen
            PARTITION_EVIDENCE["moved"] = moved
        else:
            assert seen["finished_while_cut"] == {"abort": len(moved)}, seen
        assert seen["finished_there"] == {"abort": len(moved)}, seen
        landed = []
        for _ in range(4):
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
            r = httpx.post(gw.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            landed.append(r.headers["x-replica"])
        assert name in landed, landed
        for r in reps:
            wait_idle(r.url)

    def test_a_replica_host_killed_under_streaming_load(self, cluster, fleet, expected):
        gw, reps = fleet
        survivor = reps[1 - KILLED]
        name = f"backend-{KILLED}"
        bodies = stream_bodies(1000, PARTITION_TOKENS)  # what the first partition moved
        answers = expected(survivor.url, bodies)
        wait_idle(survivor.url)
        if "moved" in PARTITION_EVIDENCE:
            # Round robin: stream i goes where stream i went in the first partition only if the
            # gateway's next pick is the same as then; the requests in between (continuations,
            # probes) need not have left it so. A probe or two sets it.
            first = name if 0 in PARTITION_EVIDENCE["moved"] else f"backend-{1 - KILLED}"
            for _ in range(2):
                body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
                r = httpx.post(gw.url + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                if r.headers["x-replica"] != first:
                    break
            assert r.headers["x-replica"] != first
        done = finished(survivor.url)
        failovers = metric(gw.url, "shoal:gateway_failovers_total")

        async def kill() -> float:
            t0 = time.monotonic()
            await asyncio.to_thread(cluster.hosts[KILLED].kill)
            while (now := await asyncio.to_thread(state, gw, name)) != "down":
                assert time.monotonic() - t0 < DOWN_BOUND_S, f"{name} still {now}"
                await asyncio.sleep(0.05)
            return time.monotonic() - t0

        outs, down_after = streams_with_fault(gw.url, bodies, kill)
        print(f"kill: marked down after {down_after:.2f}s")
        moved = [i for i, o in enumerate(outs) if o["replica"] == name]
        assert moved and len(moved) < STREAMS, [o["replica"] for o in outs]
        # Some of them lived through the partition on another replica before this death.
        if "moved" in PARTITION_EVIDENCE:  # a second strike, were the partition counted as a death
            assert set(moved) & set(PARTITION_EVIDENCE["moved"]), (moved, PARTITION_EVIDENCE["moved"])
        assert_streams_exact(outs, bodies, answers)
        assert state(gw, name) == "down"
        assert metric(gw.url, "shoal:gateway_failovers_total") - failovers == len(moved)
        # The survivor ran its own streams and each moved one's continuation, once.
        assert less(finished(survivor.url), done) == {"length": STREAMS}
        wait_idle(survivor.url)
