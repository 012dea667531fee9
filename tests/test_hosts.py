"""The test cluster of shoal.testing.hosts, for real: hosts with their own hostname, /dev/shm and
/tmp, reachable over TCP from each other and from the root namespace; a cut link partitions a host,
a limited one is slow, a killed host loses every process at once, and stop() removes exactly the
devices the cluster made."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from shoal.testing.hosts import Cluster, ClusterConfig, available

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no test cluster here: {REASON}")

PY = sys.executable
PORT = 7411  # inside a host's own network namespace: no one else's port

# On a host: accepts connections one after another; reads each to EOF, then answers as many zero
# bytes as it got. Says "ready" once listening.
SERVER = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        got = 0
        while chunk := conn.recv(1 << 16):
            got += len(chunk)
        conn.sendall(bytes(got))
"""

# Sends SIZE bytes to HOST:PORT (connecting within TIMEOUT s) and reads the echo: prints
# "ok GOT UP DOWN" (seconds each way) or "fail ERROR".
CLIENT = """
import socket, sys, time
host, port, size, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
try:
    start = time.monotonic()
    conn = socket.create_connection((host, port), timeout=timeout)
    conn.settimeout(30)
    conn.sendall(bytes(size))
    conn.shutdown(socket.SHUT_WR)
    first = conn.recv(1 << 16)
    echoed, got = time.monotonic(), len(first)
    while chunk := conn.recv(1 << 16):
        got += len(chunk)
    print("ok", got, echoed - start, time.monotonic() - echoed)
except OSError as e:
    print("fail", type(e).__name__)
"""


@pytest.fixture(scope="module")
def cluster():
    with Cluster(ClusterConfig(hosts=2)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def server(cluster):
    """SERVER on h0, at PORT."""
    proc = cluster.hosts[0].run([PY, "-c", SERVER, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def exchange(host, address: str, size: int, timeout: float = 5.0) -> tuple[str, ...]:
    """CLIENT run on host against SERVER at address: ("ok", got, up_s, down_s) or ("fail", why)."""
    return tuple(host.check_output([PY, "-c", CLIENT, address, str(PORT), str(size), str(timeout)]).split())


def links() -> dict[str, int]:
    """The root namespace's network devices: name -> ifindex."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        index, name = line.split(":")[:2]
        found[name.strip().split("@")[0]] = int(index)
    return found


def qdiscs(host) -> tuple[str, str]:
    """`tc qdisc show` of both ends of host's veth: the bridge's side, the host's side."""
    bridge_side = subprocess.run(["tc", "qdisc", "show", "dev", host.link], capture_output=True, text=True)
    return bridge_side.stdout, host.check_output(["tc", "qdisc", "show", "dev", "eth0"])


def gone(pid: int) -> bool:
    """No such process, or only its zombie (its parent outside our reach has yet to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_each_host_has_its_own_hostname_shm_and_tmp(cluster):
    h0, h1 = cluster.hosts
    assert h0.check_output(["cat", "/proc/sys/kernel/hostname"]) == "h0\n"
    assert h1.check_output(["cat", "/proc/sys/kernel/hostname"]) == "h1\n"
    assert socket.gethostname() not in ("h0", "h1")
    name = f"shoal-hosts-{uuid.uuid4().hex}"
    for directory in ("/dev/shm", "/tmp"):
        path = f"{directory}/{name}"
        h0.check_output(["sh", "-c", f"echo on-h0 > {path}"])
        assert h0.check_output(["cat", path]) == "on-h0\n"
        assert h1.check_output(["sh", "-c", f"test -e {path} && echo seen || echo unseen"]) == "unseen\n"
        assert not os.path.exists(path)
    # The rest of the filesystem is the caller's: the checkout, its interpreter, the working directory.
    assert h1.check_output([PY, "-c", "import os, shoal; print(os.getcwd())"]) == os.getcwd() + "\n"


def test_hosts_and_the_root_namespace_reach_each_other(cluster, server):
    h0, h1 = cluster.hosts
    assert exchange(h1, h0.address, 5)[:2] == ("ok", "5")
    with socket.create_connection((h0.address, PORT), timeout=2) as conn:
        conn.sendall(b"abc")
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(16) == bytes(3)
    # And a host reaches a server of the test process at the gateway address.
    with socket.create_server((cluster.gateway_address, 0)) as listener:

        def answer():
            conn, _ = listener.accept()
            with conn:
                got = 0
                while chunk := conn.recv(1 << 16):
                    got += len(chunk)
                conn.sendall(bytes(got))

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        port = listener.getsockname()[1]
        out = h1.check_output([PY, "-c", CLIENT, cluster.gateway_address, str(port), "7", "2"]).split()
        thread.join(5)
        assert out[:2] == ["ok", "7"]


def test_cut_partitions_a_host_and_restore_heals_it(cluster, server):
    h0, h1 = cluster.hosts
    assert exchange(h1, h0.address, 5)[0] == "ok"
    h0.cut()
    try:
        start = time.monotonic()
        assert exchange(h1, h0.address, 5, timeout=1.0)[0] == "fail"
        assert time.monotonic() - start < 10
        with pytest.raises(OSError):
            socket.create_connection((h0.address, PORT), timeout=1.0)
        assert server.poll() is None  # a partition, not a crash: h0's server still runs
    finally:
        h0.restore()
    assert exchange(h1, h0.address, 5)[:2] == ("ok", "5")


def test_limit_slows_the_link_both_ways_and_none_lifts_it(cluster, server):
    h0, h1 = cluster.hosts
    size = 512 * 1024
    nominal = size * 8 / 8e6  # seconds for size at 8 mbit/s
    fast = exchange(h1, h0.address, size)
    h0.limit("8mbit")
    try:
        assert all("tbf" in q for q in qdiscs(h0))
        slow = exchange(h1, h0.address, size, timeout=5)
    finally:
        h0.limit(None)
    again = exchange(h1, h0.address, size)
    assert fast[:2] == slow[:2] == again[:2] == ("ok", str(size))
    (fast_up, fast_down), (slow_up, slow_down) = map(float, fast[2:]), map(float, slow[2:])
    # h1 -> h0 meets the cap on the bridge side of h0's veth, h0 -> h1 on h0's side.
    for slow_s, fast_s in ((slow_up, fast_up), (slow_down, fast_down)):
        assert slow_s > 0.5 * nominal, (slow, fast)
        assert slow_s > 3 * fast_s, (slow, fast)
    assert float(again[2]) < slow_up / 3 and float(again[3]) < slow_down / 3, (again, slow)
    assert not any("tbf" in q for q in qdiscs(h0))


def test_the_caller_may_choose_the_subnet_but_not_one_in_use(cluster):
    taken = cluster.gateway_address.rsplit(".", 1)[0]
    with pytest.raises(ValueError, match="overlaps"):
        Cluster(ClusterConfig(subnet=taken)).start()
    with Cluster(ClusterConfig(hosts=1)) as first:
        subnet = first.gateway_address.rsplit(".", 1)[0]  # free again once first is gone
    with Cluster(ClusterConfig(hosts=2, subnet=subnet)) as chosen:
        assert chosen.gateway_address == f"{subnet}.1"
        assert [host.address for host in chosen.hosts] == [f"{subnet}.11", f"{subnet}.12"]


def test_kill_ends_every_process_on_the_host_at_once_and_spares_the_others():
    with Cluster(ClusterConfig(hosts=2)) as cluster:
        h0, h1 = cluster.hosts
        direct = h0.run(["sleep", "1000"])
        shell = h0.run(["sh", "-c", "sleep 1000 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        grandchild = int(shell.stdout.readline())
        holder = h0.pid
        other = h1.run(["sleep", "1000"])
        inside = os.readlink(f"/proc/{holder}/ns/net")
        assert all(
            os.readlink(f"/proc/{pid}/ns/net") == inside for pid in (direct.pid, shell.pid, grandchild)
        )
        assert os.readlink("/proc/self/ns/net") != inside

        h0.kill()
        assert not h0.alive
        assert direct.returncode == shell.returncode == -signal.SIGKILL
        assert gone(grandchild) and gone(holder)
        with pytest.raises(RuntimeError, match="down"):
            h0.run(["true"])
        # Its veth went with its namespace.
        deadline = time.monotonic() + 10
        while h0.link in links() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert h0.link not in links()
        # h1 runs on as before.
        assert h1.alive and other.poll() is None
        assert h1.check_output(["cat", "/proc/sys/kernel/hostname"]) == "h1\n"
        h0.kill()  # again: nothing left to do


@contextlib.contextmanager
def root_echo_server(address: str):
    """SERVER's echo, in this (the root) namespace at `address`, on a free port: yields the port."""
    with socket.create_server((address, 0)) as srv:

        def serve():
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:  # closed: the test is over
                    return
                with conn:
                    got = 0
                    while chunk := conn.recv(1 << 16):
                        got += len(chunk)
                    conn.sendall(bytes(got))

        threading.Thread(target=serve, daemon=True).start()
        yield srv.getsockname()[1]


def test_a_killed_host_leaves_the_others_talking_to_the_root_namespace():
    """The bridge keeps its MAC when a host's veth leaves it: were it to take the lowest of the
    ports left (a bridge's default), the survivors' ARP entries for the root namespace would point
    at a MAC nobody answers to for a minute. The host killed is the one whose port has the lowest
    MAC, the one the default would have lost."""

    def mac(dev: str) -> str:
        with open(f"/sys/class/net/{dev}/address") as f:
            return f.read().strip()

    with Cluster(ClusterConfig(hosts=3)) as cluster, root_echo_server(cluster.gateway_address) as port:

        def to_root(host) -> list[str]:
            argv = [PY, "-c", CLIENT, cluster.gateway_address, str(port), "1000", "3"]
            return host.check_output(argv).split()[:2]

        for host in cluster.hosts:  # each learns the root namespace's MAC
            assert to_root(host) == ["ok", "1000"]
        bridge_mac = mac(cluster.bridge)
        victim = min(cluster.hosts, key=lambda h: mac(h.link))
        victim.kill()
        deadline = time.monotonic() + 10
        while victim.link in links() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert mac(cluster.bridge) == bridge_mac
        for host in cluster.hosts:
            if host is not victim:
                assert to_root(host) == ["ok", "1000"], host.name


def test_stop_removes_the_clusters_devices_and_touches_nothing_else():
    before = links()
    cluster = Cluster(ClusterConfig(hosts=2)).start()
    ours = {cluster.bridge, *(host.link for host in cluster.hosts)}
    assert ours <= set(links()) and not ours & set(before)
    proc = cluster.hosts[0].run(["sleep", "1000"])
    holders = [host.pid for host in cluster.hosts]

    cluster.stop()
    after = links()
    assert not ours & set(after)
    # Every other device is still there, the same device (same ifindex). Another session's cluster
    # (devices named shb*/shv*) may come and go meanwhile.
    others = {name: index for name, index in before.items() if not name.startswith(("shb", "shv"))}
    assert {name: after.get(name) for name in others} == others
    assert proc.poll() == -signal.SIGKILL
    assert all(gone(pid) for pid in holders)
    cluster.stop()  # twice is fine


@pytest.mark.parametrize("ending", ["exit", "SIGKILL"])
def test_a_process_that_ends_without_stop_leaves_nothing_behind(ending):
    """atexit tears down on an ordinary exit; after SIGKILL, each holder sees its stdin close and
    tears its host (and the bridge) down itself."""
    script = f"""
import os, subprocess
from shoal.testing.hosts import Cluster, ClusterConfig
cluster = Cluster(ClusterConfig(hosts=2)).start()
shell = cluster.hosts[0].run(["sh", "-c", "sleep 1000 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
print(cluster.bridge, *(h.link for h in cluster.hosts), *(h.pid for h in cluster.hosts), shell.pid,
      shell.stdout.readline(), flush=True)
if {ending!r} == "SIGKILL":
    os.kill(os.getpid(), 9)
"""
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=60).stdout.split()
    assert len(out) == 7, out
    devices, pids = out[:3], [int(pid) for pid in out[3:]]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (set(devices) & set(links()) or not all(map(gone, pids))):
        time.sleep(0.05)
    assert not set(devices) & set(links())
    assert all(map(gone, pids))


def test_command_line_up_lists_the_hosts_and_tears_down_on_interrupt():
    # Started with SIGINT blocked, as a parent's thread may leave it (the mask is inherited): the
    # command still ends on it.
    proc = subprocess.Popen(
        [PY, "-m", "shoal.testing.hosts", "up", "--hosts", "2"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}),
    )
    try:
        gateway = proc.stdout.readline().split()
        hosts = [proc.stdout.readline().split() for _ in range(2)]
        assert gateway[0] == "gateway" and [h[0] for h in hosts] == ["h0", "h1"]
        bridge, holders = gateway[3], [int(h[3]) for h in hosts]
        assert bridge in links() and not any(gone(pid) for pid in holders)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0  # a loaded machine tears down slowly
    finally:
        proc.kill()
        proc.wait()
    assert bridge not in links()
    assert all(gone(pid) for pid in holders)
