"""A tensor-parallel engine when a rank dies or hangs, when its driver is killed, when it fails
to start, and when its ranks are started by hand (as on other hosts): real processes throughout."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from shoal import LLM, SamplingParams
from shoal.engine.parallel.executor import ExecutorDeadError
from shoal.engine.parallel.worker import AUTHKEY_ENV
from tests.fleet_helpers import replicas, start_fleet, wait_replicas_ready
from tests.server_helpers import free_port, sse_objects, start_server
from tests.test_parallel import _parallel_pids

SERVE_ARGS = ("-tp", "2", "--threads", "1", "--kv-cache-memory", "128MiB", "--rank-timeout", "5")
# A rank's death or hang must reach the client within this (the rank timeout above, plus slack).
ERROR_BOUND_S = 10.0
LONG = {
    "model": "SmolLM2-135M-Instruct",
    "prompt": "Once upon a time",
    "max_tokens": 400,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


def ranks_of(pid: int) -> list[int]:
    """The rank processes whose parent is `pid`."""
    found = []
    for p in _parallel_pids():
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(p)
        except (OSError, ValueError):
            continue
    return sorted(found)


def wait_gone(pids, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not set(pids) & _parallel_pids():
            return
        time.sleep(0.1)
    raise AssertionError(f"rank processes left behind: {set(pids) & _parallel_pids()}")


def stream_until_broken(url: str, after_chunks: int, act) -> tuple[int, float | None, bool]:
    """Streams LONG; after `after_chunks` text chunks calls `act()`. Returns (chunks, seconds from
    the act to the stream's error or end, whether an error event arrived)."""
    chunks, acted_at, errored = 0, None, False
    with httpx.stream("POST", url + "/v1/completions", json=LONG, timeout=60) as r:
        assert r.status_code == 200
        try:
            for obj in sse_objects(r):
                if "error" in obj:
                    errored = True
                    break
                chunks += 1
                if chunks == after_chunks:
                    act()
                    acted_at = time.monotonic()
        except httpx.HTTPError:
            errored = True  # the connection closed mid-stream: the client knows it is cut short
    return chunks, None if acted_at is None else time.monotonic() - acted_at, errored


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_dead_or_hung_rank_ends_the_stream_with_an_error_in_bounded_time(how):
    server = start_server(*SERVE_ARGS)
    try:
        ranks = ranks_of(server.proc.pid)
        assert len(ranks) == 2
        sig = signal.SIGKILL if how == "kill" else signal.SIGSTOP
        chunks, took, errored = stream_until_broken(server.url, 5, lambda: os.kill(ranks[1], sig))
        assert errored and chunks < 400, (chunks, server.log()[-3000:])
        assert took < ERROR_BOUND_S, took
        # The replica then reports itself unhealthy and exits, for its supervisor to restart it.
        assert server.proc.wait(ERROR_BOUND_S) != 0
        wait_gone(ranks)  # the stopped rank too
    finally:
        server.stop()


def test_a_rank_dying_while_idle_turns_health_503():
    server = start_server(*SERVE_ARGS)
    try:
        ranks = ranks_of(server.proc.pid)
        assert server.get("/health").status_code == 200
        body = {**LONG, "stream": False, "max_tokens": 8}
        assert server.post("/v1/completions", json=body).status_code == 200
        # Each rank's profile: its steps, and the time it spent in collectives.
        metrics = server.get("/metrics").text
        label = 'model_name="SmolLM2-135M-Instruct",rank='
        for rank in (0, 1):
            assert f'shoal:parallel_rank_steps_total{{{label}"{rank}"}}' in metrics
        assert f'shoal:parallel_rank_comm_seconds_total{{{label}"1"}}' in metrics
        os.kill(ranks[0], signal.SIGKILL)
        t0 = time.monotonic()
        status = 200
        while status == 200 and time.monotonic() - t0 < ERROR_BOUND_S:
            try:
                status = server.get("/health").status_code
            except httpx.HTTPError:
                status = None  # already exited
            time.sleep(0.1)
        assert status != 200
        assert server.proc.wait(ERROR_BOUND_S) != 0
        wait_gone(ranks)
    finally:
        server.stop()


def test_ranks_end_with_a_driver_killed_9():
    server = start_server(*SERVE_ARGS)
    ranks = ranks_of(server.proc.pid)
    assert len(ranks) == 2
    server.proc.kill()
    server.proc.wait()
    wait_gone(ranks)


def test_a_failed_start_leaves_no_rank_behind():
    before = _parallel_pids()
    # The ranks, not the driver, find that there is no CUDA device here.
    with pytest.raises(ExecutorDeadError, match="rank"):
        LLM(quantization="none", tensor_parallel_size=2, device="cuda:0", startup_timeout_s=60)
    wait_gone(_parallel_pids() - before)
    assert _parallel_pids() <= before


def test_ranks_started_by_hand_join_a_driver_that_waits_for_them():
    """The multi-host path: the driver starts no ranks; each is started on its own (here all on
    127.0.0.1) with `shoal worker`, connects to the driver's address and rendezvous."""
    key = secrets.token_hex(16)
    port = free_port()
    env = {**os.environ, AUTHKEY_ENV: key}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "worker", "--driver", f"127.0.0.1:{port}", "--rank", str(r)],
            env=env,
        )
        for r in range(2)
    ]
    os.environ[AUTHKEY_ENV] = key
    try:
        opts = dict(quantization="none", num_blocks=128, pipeline_parallel_size=2)
        with LLM(launch_workers=False, distributed_port=port, **opts) as llm:
            got = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12))
        want = LLM(quantization="none", num_blocks=128).generate(
            "The capital of France is", SamplingParams(temperature=0, max_tokens=12)
        )
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
        for p in procs:
            assert p.wait(15) == 0  # told to stop by the driver's shutdown
    finally:
        del os.environ[AUTHKEY_ENV]
        for p in procs:
            p.kill()


def test_a_two_replica_fleet_finishes_the_stream_when_a_rank_dies():
    gw = start_fleet(2, "--replica-args", " ".join(SERVE_ARGS))
    try:
        body = {**LONG, "max_tokens": 48}
        expected = _stream_text(gw.url, body)
        pids = {name: r["pid"] for name, r in replicas(gw).items()}
        killed = threading.Event()

        def kill_serving_rank(name: str) -> None:
            os.kill(ranks_of(pids[name])[0], signal.SIGKILL)
            killed.set()

        got = _stream_text(gw.url, body, kill_after=10, kill=kill_serving_rank)
        assert killed.is_set()
        assert got == expected  # whole, token for token, despite the dead rank
        wait_replicas_ready(gw, 2)  # the broken replica is restarted
    finally:
        gw.stop()


def _stream_text(url: str, body: dict, kill_after: int | None = None, kill=None) -> str:
    text, n = "", 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        replica = r.headers["x-replica"]
        for obj in sse_objects(r):
            assert "error" not in obj, obj
            for ch in obj["choices"]:
                text += ch.get("text") or ""
            n += 1
            if n == kill_after:
                kill(replica)
    return text
