"""A cluster of "hosts" on one Linux machine, for tests and benchmarks that need several machines.

Each host is a holder process that owns its own network, UTS (hostname) and mount namespaces, with
private tmpfs mounts on /dev/shm and /tmp. Hosts hang off one bridge in the root namespace by veth
pairs, each with its own IPv4 address on a private /24; the root namespace has the ".1" on the
bridge, so the caller reaches every host. Processes run on a host by entering the holder's
namespaces with nsenter; they see the caller's filesystem except /dev/shm and /tmp.

Everything is made and removed by handle: the devices carry a random suffix, and teardown deletes
exactly the devices this cluster made and kills exactly the processes in its hosts' namespaces.
If the process that made a cluster dies without stop() (even by SIGKILL), each holder sees its stdin
close and does that teardown itself. Needs root, `ip`, `tc`, `unshare` and `nsenter`.

    python -m shoal.testing.hosts up --hosts 3
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from shoal.testing import netns
from shoal.testing.netns import ClusterUnavailable

_TOOLS = ("ip", "tc", "unshare", "nsenter")
_FIRST_HOST = 11  # host i gets SUBNET.(11 + i); the bridge (root namespace) gets SUBNET.1
_MAX_HOSTS = 200
_HOST_IFNAME = "eth0"  # the host side of its veth, as a real machine would call it

# The holder sets its host up from the inside, then waits. It runs right after unshare(2) made the
# namespaces private (unshare's --propagation private ran before exec), so its mounts stay inside.
# Paths under /tmp that must stay visible on the host (a checkout or venv that lives there) are
# bind-mounted aside onto the new /dev/shm, then moved onto the new /tmp. It waits on stdin, a pipe
# whose other end only the cluster's process holds: EOF means that process ended without stop(),
# and the holder does the teardown itself (its host's processes, then the bridge, by name, in the
# root namespace it holds open as fd ROOTFD). stop() SIGKILLs holders and never gets here.
# Arguments: hostname, ip, nsenter, bridge, ROOTFD, then the paths to keep.
_HOLDER_SCRIPT = """set -e
name=$1; ip=$2; nsenter=$3; bridge=$4; rootfd=$5; shift 5
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
i=0
for keep in "$@"; do mkdir /dev/shm/.keep$i; mount --rbind "$keep" /dev/shm/.keep$i; i=$((i+1)); done
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
i=0
for keep in "$@"; do
    mkdir -p "$keep"; mount --move /dev/shm/.keep$i "$keep"; rmdir /dev/shm/.keep$i; i=$((i+1))
done
echo "$name" > /proc/sys/kernel/hostname
"$ip" link set lo up
echo ready
read -r _ || true
set +e
exec >/dev/null 2>&1  # our ends of stdout and stderr are closed: a write would kill us midway
for round in 1 2 3; do
    kill -9 $(find -L /proc/[0-9]*/ns/net -maxdepth 0 -samefile /proc/$$/ns/net 2>/dev/null |
        cut -d/ -f3 | grep -vx $$) 2>/dev/null
done
"$nsenter" --net=/proc/$$/fd/$rootfd "$ip" link del dev "$bridge" 2>/dev/null
"""

# What available() tries, in throwaway namespaces that vanish with the probe: everything start()
# needs the kernel for (namespaces, tmpfs, bridge, veth, tbf).
_PROBE_SCRIPT = """set -e
mount -t tmpfs tmpfs /tmp
echo probe > /proc/sys/kernel/hostname
"$1" link add probe-br type bridge
"$1" link add probe-a type veth peer name probe-b
"$1" link set probe-b master probe-br
"$2" qdisc add dev probe-a root tbf rate 1mbit burst 64kb latency 100ms
"""


@dataclass
class ClusterConfig:
    hosts: int = 2
    subnet: str | None = None  # e.g. "10.213.7": bridge .1, hosts .11, .12, ...; None: a free one
    # Paths under /tmp that stay visible on every host, each by its top directory under /tmp (the
    # host's /tmp is otherwise empty). None: the running checkout, virtual environment and working
    # directory, those of them under /tmp (a checkout in /tmp/x runs on the hosts as it does here).
    keep: tuple[str, ...] | None = None


@functools.cache
def available() -> str | None:
    """None when clusters can be made here, else the reason (for pytest.skip)."""
    if not sys.platform.startswith("linux"):
        return "needs Linux namespaces"
    if os.geteuid() != 0:
        return "needs root (network and mount namespaces, bridges, veth pairs)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} on PATH"
    probe = [netns.tool("unshare"), "--net", "--uts", "--mount", "--propagation", "private", "--"]
    try:
        done = subprocess.run(
            [*probe, "sh", "-c", _PROBE_SCRIPT, "sh", netns.tool("ip"), netns.tool("tc")],
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"namespaces can't be made here: {e}"
    if done.returncode:
        return f"namespaces can't be made here: {done.stderr.strip() or done.returncode}"
    return None


class Host:
    """One host of a Cluster: a holder process and the namespaces it owns."""

    def __init__(self, name: str, address: str, link: str, holder: subprocess.Popen, kept: tuple[str, ...]):
        self.name = name  # also its hostname inside
        self.address = address
        self.link = link  # the root-side end of its veth, on the bridge
        self._holder = holder
        self._kept = kept  # the paths under /tmp it shares with the caller
        self._procs: list[subprocess.Popen] = []
        self._rate: str | None = None
        # An open handle on the host's network namespace: the namespace can't die (and its inode
        # number can't be reused by another one) while we hold it, so "the processes in this
        # namespace" stays exact until kill() has ended them all.
        self._netns_fd: int | None = os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY)
        st = os.fstat(self._netns_fd)
        self._netns = (st.st_dev, st.st_ino)

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address}, pid={self.pid}, alive={self.alive})"

    @property
    def pid(self) -> int:
        """The holder's pid: `nsenter --target PID --net --uts --mount` runs a command here."""
        return self._holder.pid

    @property
    def alive(self) -> bool:
        # poll() reaps the holder once it has died; until then its pid can't be reused, so
        # nsenter --target never lands in a stranger's namespaces.
        return self._netns_fd is not None and self._holder.poll() is None

    def run(self, argv: list[str], env: dict | None = None, **popen_kwargs) -> subprocess.Popen:
        """A process on this host (Popen's arguments; env replaces the environment as Popen's
        does); kill() and the cluster's stop() end it."""
        if not self.alive:
            raise RuntimeError(f"host {self.name} is down")
        # nsenter --mount puts the process at the namespace's root unless told where to be.
        cwd = popen_kwargs.pop("cwd", None)
        wd = os.path.abspath(cwd) if cwd is not None else netns.default_wd(self._kept)
        command = [netns.tool("nsenter"), f"--target={self.pid}", "--net", "--uts", "--mount", f"--wd={wd}"]
        proc = subprocess.Popen([*command, "--", *map(os.fspath, argv)], env=env, **popen_kwargs)
        self._procs = [p for p in self._procs if p.poll() is None]
        self._procs.append(proc)
        return proc

    def check_output(self, argv: list[str], *, timeout: float = 60, input=None, **kw) -> str:
        """Runs argv to completion on this host and returns its stdout (CalledProcessError if it
        fails, as subprocess.check_output)."""
        kw.setdefault("text", True)
        kw.setdefault("stdin", subprocess.PIPE if input is not None else subprocess.DEVNULL)
        proc = self.run(argv, stdout=subprocess.PIPE, **kw)
        try:
            out, _ = proc.communicate(input, timeout=timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, argv, out)
        return out

    def kill(self) -> None:
        """The whole host dies at once, as a machine losing power: SIGKILL to every process in its
        network namespace, the holder included. Its veth goes with the namespace."""
        if self._netns_fd is None:
            return
        deadline = time.monotonic() + 10
        while True:
            # Our own processes by handle too: one may still be in nsenter, not yet inside.
            pids = {*netns.pids_in_netns(self._netns), *(p.pid for p in self._procs if p.poll() is None)}
            if not pids:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {self.name}: processes {sorted(pids)} survive SIGKILL")
            # Stopped first, all of them, then killed: otherwise a parent whose child died a moment
            # before it could see that death and exit on its own, which a power cut never allows.
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            time.sleep(0.005)  # exits are asynchronous; look again until none is left
        for proc in (*self._procs, self._holder):
            proc.wait()
        self._procs.clear()
        if self._holder.stdin:
            self._holder.stdin.close()
        os.close(self._netns_fd)  # the namespace, and so the veth, can go now
        self._netns_fd = None

    def cut(self) -> None:
        """Its link down, a network partition; its processes keep running."""
        self._root_link("down")

    def restore(self) -> None:
        """Its link up again after cut()."""
        self._root_link("up")

    def limit(self, rate: str | None) -> None:
        """Caps its link at rate ("1gbit", "100mbit", ...) both ways: a token bucket on the egress of
        both ends of its veth. None or "" lifts the cap."""
        if not self.alive:
            raise RuntimeError(f"host {self.name} is down")
        inside = [netns.tool("nsenter"), f"--target={self.pid}", "--net", "--", netns.tool("tc")]
        if not rate:
            if self._rate:
                netns.run([netns.tool("tc"), "qdisc", "del", "dev", self.link, "root"])
                netns.run([*inside, "qdisc", "del", "dev", _HOST_IFNAME, "root"])
            self._rate = None
            return
        bits = netns.rate_bits(rate)
        # The bucket holds 10 ms at the rate (timer granularity), and at least 64 KiB, so that a
        # full-size GSO packet from the veth passes whole.
        burst = max(bits // 8 // 100, 64 * 1024)
        tbf = ["root", "tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "100ms"]
        netns.run([netns.tool("tc"), "qdisc", "replace", "dev", self.link, *tbf])
        netns.run([*inside, "qdisc", "replace", "dev", _HOST_IFNAME, *tbf])
        self._rate = rate

    def _root_link(self, state: str) -> None:
        if not self.alive:
            raise RuntimeError(f"host {self.name} is down")
        netns.run([netns.tool("ip"), "link", "set", "dev", self.link, state])


class Cluster:
    """N hosts on one bridge; start() makes them, stop() removes exactly what start() made."""

    def __init__(self, config: ClusterConfig | None = None):
        self.config = config or ClusterConfig()
        self.hosts: list[Host] = []
        self.gateway_address = ""
        self.bridge = ""
        self._links: list[str] = []  # the root-namespace devices we made, in order
        self._started = False
        self._stopped = False

    def start(self) -> Cluster:
        """Makes the bridge and the hosts; ClusterUnavailable if that can't be done here."""
        if self._started:
            raise RuntimeError("cluster already started")
        if not 1 <= self.config.hosts <= _MAX_HOSTS:
            raise ValueError(f"hosts must be 1..{_MAX_HOSTS}, not {self.config.hosts}")
        reason = available()
        if reason:
            raise ClusterUnavailable(reason)
        subnet = self.config.subnet or netns.free_subnet()
        netns.check_subnet(subnet)
        self._started = True
        atexit.register(self.stop)  # before anything exists: a failure midway is undone too
        suffix = secrets.token_hex(3)
        keep = netns.default_keep() if self.config.keep is None else netns.outermost(self.config.keep)
        holders: list[subprocess.Popen] = []
        try:
            self.gateway_address = f"{subnet}.1"
            self._add_link(f"shb{suffix}", "type", "bridge", "forward_delay", "0")
            self.bridge = f"shb{suffix}"
            # A bridge otherwise takes the lowest MAC among its ports, so killing a host whose veth
            # had it changed the bridge's MAC: the other hosts sent to the stale one for as long as
            # their ARP entries lived (~60 s of lost traffic to this namespace). Set, it stays.
            mac = "02:53:68:" + ":".join(suffix[i : i + 2] for i in range(0, 6, 2))
            netns.run([netns.tool("ip"), "link", "set", "dev", self.bridge, "address", mac])
            netns.run([netns.tool("ip"), "addr", "add", f"{self.gateway_address}/24", "dev", self.bridge])
            netns.run([netns.tool("ip"), "link", "set", "dev", self.bridge, "up"])
            root_fd = os.open("/proc/self/ns/net", os.O_RDONLY)
            try:
                holders += [
                    _start_holder(f"h{i}", self.bridge, root_fd, keep) for i in range(self.config.hosts)
                ]
            finally:
                os.close(root_fd)
            for i, holder in enumerate(holders):
                self._wire(i, holder, subnet, suffix, keep)
        except BaseException as e:
            wired = {host.pid for host in self.hosts}  # stop() ends these; the others are bare holders
            for holder in holders:
                if holder.pid not in wired:
                    holder.kill()
                    holder.wait()
            with contextlib.suppress(RuntimeError):  # the first failure is the one to report
                self.stop()
            if isinstance(e, RuntimeError) and not isinstance(e, ClusterUnavailable):
                raise ClusterUnavailable(str(e)) from e
            raise
        return self

    def stop(self) -> None:
        """Kills every process on every host, then deletes this cluster's devices. Safe twice."""
        if self._stopped or not self._started:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        errors = []
        for host in self.hosts:
            try:
                host.kill()
            except RuntimeError as e:
                errors.append(str(e))
        for name in reversed(self._links):  # veths first, the bridge last
            done = subprocess.run(
                [netns.tool("ip"), "link", "del", "dev", name], capture_output=True, text=True
            )
            # A killed host's veth may be gone already (or going, with its namespace).
            if done.returncode and netns.link_exists(name):
                errors.append(f"ip link del {name}: {done.stderr.strip()}")
        if errors:
            raise RuntimeError("; ".join(errors))

    def __enter__(self) -> Cluster:
        return self if self._started else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _add_link(self, name: str, *spec: str) -> None:
        # `ip link add` fails when the name exists, so a device in _links is always one we made.
        netns.run([netns.tool("ip"), "link", "add", "name", name, *spec])
        self._links.append(name)

    def _wire(self, i: int, holder: subprocess.Popen, subnet: str, suffix: str, keep: tuple) -> None:
        name, address, link = f"h{i}", f"{subnet}.{_FIRST_HOST + i}", f"shv{suffix}-{i}"
        _wait_ready(name, holder)
        # The peer is born inside the host's namespace: it never exists in the root namespace.
        self._add_link(link, "type", "veth", "peer", "name", f"shp{suffix}-{i}", "netns", str(holder.pid))
        self.hosts.append(Host(name, address, link, holder, keep))
        netns.run([netns.tool("ip"), "link", "set", "dev", link, "master", self.bridge, "up"])
        batch = (
            f"link set dev shp{suffix}-{i} name {_HOST_IFNAME}\n"
            f"addr add {address}/24 dev {_HOST_IFNAME}\n"
            f"link set dev {_HOST_IFNAME} up\n"
        )
        netns.run(
            [netns.tool("nsenter"), f"--target={holder.pid}", "--net", "--", netns.tool("ip"), "-batch", "-"],
            batch,
        )


def _start_holder(name: str, bridge: str, root_fd: int, keep: tuple[str, ...]) -> subprocess.Popen:
    # No --fork: unshare execs the script, so the holder's pid is the Popen's (our child, which
    # keeps its pid from being reused until we reap it).
    argv = [netns.tool("unshare"), "--net", "--uts", "--mount", "--propagation", "private", "--"]
    argv += [
        "sh",
        "-c",
        _HOLDER_SCRIPT,
        "sh",
        name,
        netns.tool("ip"),
        netns.tool("nsenter"),
        bridge,
        str(root_fd),
    ]
    return subprocess.Popen(
        [*argv, *keep],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd="/",
        pass_fds=(root_fd,),
    )


def _wait_ready(name: str, holder: subprocess.Popen, timeout: float = 30) -> None:
    assert holder.stdout is not None and holder.stderr is not None
    deadline, said = time.monotonic() + timeout, b""
    while b"\n" not in said and time.monotonic() < deadline:
        if select.select([holder.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(holder.stdout.fileno(), 64)
            if not chunk:
                break
            said += chunk
    if said.strip() != b"ready":
        holder.kill()
        holder.wait()
        why = holder.stderr.read().decode(errors="replace").strip()
        raise ClusterUnavailable(f"host {name} did not start: {why or 'no answer'}")
    holder.stdout.close()
    holder.stderr.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shoal.testing.hosts", description="A test cluster of hosts."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="make a cluster, print its hosts, remove it on Ctrl-C")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--subnet", help="e.g. 10.213.7 (default: a free one)")
    args = parser.parse_args(argv)
    reason = available()
    if reason:
        print(f"no cluster: {reason}", file=sys.stderr)
        return 1

    def interrupt(*_):
        raise KeyboardInterrupt

    # `kill PID` tears down as Ctrl-C does. Both are taken whatever the parent left behind: a
    # signal it ignored or blocked (the mask is inherited) would leave the cluster up for good.
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    # An interrupt at any point, even while the hosts are printed, tears the cluster down.
    with contextlib.suppress(KeyboardInterrupt), Cluster(ClusterConfig(args.hosts, args.subnet)) as cluster:
        print(f"gateway {cluster.gateway_address} bridge {cluster.bridge}")
        for host in cluster.hosts:
            print(f"{host.name} {host.address} holder {host.pid}")
        print("on a host: nsenter --target HOLDER --net --uts --mount --wd=$PWD -- CMD", flush=True)
        while True:
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
