"""The machine-level steps behind shoal.testing.hosts: the tools it runs, the processes in a
network namespace, free subnets, link rates, and which paths under /tmp a host keeps."""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

PRIVATE_DIRS = ("/dev/shm", "/tmp")  # what every host has a fresh one of

RATE_UNITS = {
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9,
}  # fmt: skip


class ClusterUnavailable(RuntimeError):
    """Clusters can't be made here; the message says why."""


def pids_in_netns(netns: tuple[int, int]) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            # Gone, or a zombie (its namespaces are released already): not in any namespace.
            with contextlib.suppress(OSError):
                st = os.stat(f"/proc/{entry.name}/ns/net")
                if (st.st_dev, st.st_ino) == netns:
                    pids.append(int(entry.name))
    return pids


def default_keep() -> tuple[str, ...]:
    # The top directories under /tmp holding what a process on a host needs to be the caller's
    # twin: the checkout this module is in, the interpreter's environment, the working directory.
    here = Path(__file__).resolve().parents[2]
    return outermost((str(here), sys.prefix, os.getcwd()))


def outermost(paths) -> tuple[str, ...]:
    keep = set()
    for path in paths:
        parts = Path(os.path.realpath(path)).parts
        if len(parts) > 2 and parts[1] == "tmp":
            keep.add(f"/tmp/{parts[2]}")
    return tuple(sorted(keep))


def default_wd(kept: tuple[str, ...]) -> str:
    # The caller's working directory, unless it lies in a private directory the host doesn't share.
    cwd = os.getcwd()
    hidden = any(cwd == d or cwd.startswith(d + "/") for d in PRIVATE_DIRS)
    shared = any(cwd == k or cwd.startswith(k + "/") for k in kept)
    return cwd if shared or not hidden else "/"


def free_subnet() -> str:
    used = used_networks()
    for _ in range(200):
        subnet = f"10.{random.randint(200, 254)}.{random.randint(1, 254)}"
        network = ipaddress.ip_network(f"{subnet}.0/24")
        if not any(network.overlaps(u) for u in used):
            return subnet
    raise ClusterUnavailable("no free /24 in 10.200-254.x")


def check_subnet(subnet: str) -> None:
    if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
        raise ValueError(f"subnet must look like 10.213.7, not {subnet!r}")
    network = ipaddress.ip_network(f"{subnet}.0/24")
    clash = [str(u) for u in used_networks() if network.overlaps(u)]
    if clash:
        raise ValueError(f"subnet {subnet}.0/24 overlaps {', '.join(clash)} on this machine")


def used_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this machine's addresses and routes cover (default routes aside)."""
    used = []
    for line in run([tool("ip"), "-o", "-4", "addr", "show"]).splitlines():
        match = re.search(r"\binet (\S+)", line)
        if match:
            used.append(ipaddress.ip_network(match.group(1), strict=False))
    for line in run([tool("ip"), "-o", "-4", "route", "show", "table", "all"]).splitlines():
        words = line.split()
        # A route's first word is its destination, or its type and then the destination.
        dest = words[1] if len(words) > 1 and words[0] in _ROUTE_TYPES else words[0] if words else ""
        with contextlib.suppress(ValueError):
            used.append(ipaddress.ip_network(dest, strict=False))
    return used


_ROUTE_TYPES = {"unicast", "local", "broadcast", "multicast", "anycast", "blackhole", "unreachable",
                "prohibit", "throw", "nat"}  # fmt: skip


def rate_bits(rate: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", rate.lower())
    unit = (match.group(2) or "bit") if match else ""
    if not match or unit not in RATE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"rate must look like 100mbit or 1gbit, not {rate!r}")
    return int(float(match.group(1)) * RATE_UNITS[unit])


def link_exists(name: str) -> bool:
    return subprocess.run([tool("ip"), "link", "show", "dev", name], capture_output=True).returncode == 0


@functools.cache
def tool(name: str) -> str:
    return shutil.which(name) or name


def run(argv: list[str], stdin: str | None = None) -> str:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout
