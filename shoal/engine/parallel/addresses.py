"""Where a rank is reached: its address on the route to the driver, and the network interface
that carries an address (what gloo binds to)."""

from __future__ import annotations

import fcntl
import socket
import struct
from dataclasses import dataclass

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


@dataclass(frozen=True)
class DriverLink:
    """How a rank reaches its driver, and how its peers reach it."""

    driver_host: str
    authkey: bytes
    advertise_host: str


def address_towards(host: str) -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP socket only routes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def interface_of(address: str) -> str:
    """The name of the interface holding IPv4 `address` (loopback addresses are on `lo`)."""
    if address.startswith("127."):
        return "lo"
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    raise ValueError(f"no network interface on {socket.gethostname()} has the address {address}")
