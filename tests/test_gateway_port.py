"""The gateway's own port: bound before the fleet picks any port of its own, so that no replica is
ever given it (CI once saw a fleet hand its gateway's port to a replica, then fail to bind it);
taken, a clear refusal before anything starts; 0, any free port, which the gateway says."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import httpx

from shoal.cli import main
from shoal.fleet.control.launchers.local import LocalLauncher


def test_a_taken_gateway_port_is_refused_before_a_replica_is_started(capsys):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for argv in (
            ["fleet", "up", "--replicas", "2", "--base-port", "0", "--port", str(port)],
            ["gateway", "--backend", "http://127.0.0.1:9", "--port", str(port)],
        ):
            assert main(argv) == 1
            out = capsys.readouterr()
            assert f"port {port} already in use" in out.err
            assert "starting" not in out.out  # no replica was launched


def test_port_0_serves_on_a_free_port_the_gateway_names():
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "gateway", "--backend", "http://127.0.0.1:9", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        url = re.search(r"the API is at (http://127\.0\.0\.1:(\d+))/v1", line)
        assert url and url.group(2) != "0", line
        deadline = time.monotonic() + 30
        while True:
            try:
                reps = httpx.get(url.group(1) + "/replicas", timeout=2).json()["replicas"]
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert [r["url"] for r in reps] == ["http://127.0.0.1:9"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_launcher_never_gives_two_replicas_the_same_free_port():
    # The kernel hands a port out again as soon as it is free: of 3000 plain picks here, 289 were
    # repeats. A replica given a free port binds it only once it has started.
    launcher = LocalLauncher()
    ports = [launcher.port_for(0, i) for i in range(3000)]
    assert len(set(ports)) == len(ports)
    assert [launcher.port_for(9000, i) for i in range(3)] == [9000, 9001, 9002]
