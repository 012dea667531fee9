"""How a packed request's K/V moves between workers, behind one interface: the prefill side
`send`s it (what answers a pull), the decode side `receive`s the reply, and a copy nobody took
is `discard`ed. Shared memory on one host (the reply names a file that holds the frame), TCP
between hosts (the reply is the frame itself, the body of an HTTP response).

NIXL (RDMA between GPUs' memory) is named but not built: it needs GPU K/V pools registered with
its agent, which this CPU build has no way to exercise. Asking for it is an error that says so
(and whether the package is there), never a silent fallback to another transport."""

from __future__ import annotations

import os
from typing import Protocol

from shoal.engine.kv_connector.frames import TransferError, decode, encode, header, raw
from shoal.engine.kv_connector.packing import PackedKV
from shoal.protocol.kv_files import (
    PROBE_NAME,
    PROBE_PREFIX,
    SHM_DIR,
    SHM_NAME,
    new_name,
    shm_available,
    shm_unlink,
)

TRANSPORTS = ("auto", "shm", "tcp", "nixl")


class KVTransport(Protocol):
    name: str
    reply_is_json: bool  # the reply is a small JSON body (else the frame's bytes)

    def send(self, packed: PackedKV) -> tuple[dict | bytes, str | None]:
        """The reply to a pull, and a reference to `discard` if nobody takes it (or None)."""
        ...

    def receive(self, reply: dict | bytearray) -> PackedKV:
        """The K/V a reply carries or names."""
        ...

    def take(self, reply: dict | bytearray) -> PackedKV:
        """`receive`, then frees what the reply named: the receiver owns the K/V now, and nothing
        is left behind even if its sender dies before hearing so."""
        ...

    def discard(self, ref: str) -> None: ...


class ShmTransport:
    name = "shm"
    reply_is_json = True

    def send(self, packed: PackedKV) -> tuple[dict, str]:
        """Writes the frame to a new shared-memory file only this user can read."""
        name = new_name()
        fd = os.open(SHM_DIR / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header(packed))
                f.write(memoryview(raw(packed.data)))
        except BaseException:
            shm_unlink(name)
            raise
        return {"name": name, "num_tokens": packed.num_tokens}, name

    def receive(self, reply: dict) -> PackedKV:
        name = reply.get("name") if isinstance(reply, dict) else None
        if not isinstance(name, str) or not SHM_NAME.fullmatch(name):
            raise TransferError("not a shared-memory K/V name this worker reads")
        try:
            with open(SHM_DIR / name, "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                if f.readinto(buf) != len(buf):
                    raise TransferError("the shared-memory K/V was cut short")
        except OSError as exc:
            raise TransferError(f"the shared-memory K/V could not be read: {exc}") from None
        return decode(buf)

    def take(self, reply: dict) -> PackedKV:
        try:
            return self.receive(reply)
        finally:
            name = reply.get("name") if isinstance(reply, dict) else None
            if isinstance(name, str):
                shm_unlink(name)  # only ever one of ours: it checks the name

    def discard(self, ref: str) -> None:
        shm_unlink(ref)


class TcpTransport:
    name = "tcp"
    reply_is_json = False

    def send(self, packed: PackedKV) -> tuple[bytes, None]:
        return encode(packed), None

    def receive(self, reply: bytearray) -> PackedKV:
        return decode(reply)

    def take(self, reply: bytearray) -> PackedKV:
        return decode(reply)

    def discard(self, ref: str) -> None:
        pass  # nothing outlives the response


def transport_named(name: str) -> KVTransport:
    if name == "shm":
        return ShmTransport()
    if name == "tcp":
        return TcpTransport()
    check_transport(name)
    raise ValueError(f"{name!r} names no single transport")


def shm_probe() -> str | None:
    """A file in /dev/shm that holds its own name, published by a prefill worker: a puller that
    reads it back shares this /dev/shm (a host name, even with the boot id, says nothing of that:
    two containers on one machine share both and not /dev/shm). Named with its writer's pid, so
    the sweep of a later worker removes it once its process is gone."""
    if not shm_available():
        return None
    name = new_name(PROBE_PREFIX)
    try:
        (SHM_DIR / name).write_text(name)
    except OSError:
        return None
    return name


def sees_shm_probe(name: object) -> bool:
    """Whether a peer's probe file is here, with its content (a name from the wire: only ours)."""
    if not isinstance(name, str) or not PROBE_NAME.fullmatch(name):
        return False
    try:
        return (SHM_DIR / name).read_text() == name
    except OSError:
        return False


def nixl_available() -> bool:
    try:
        import nixl  # noqa: F401
    except ImportError:
        return False
    return True


def check_transport(name: str) -> None:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose from {', '.join(TRANSPORTS)}")
    if name == "nixl":
        have = "installed" if nixl_available() else "not installed"
        raise ValueError(
            f"the nixl KV transport is not built yet (the nixl package is {have}); use shm or tcp"
        )
    if name == "shm" and not shm_available():
        raise ValueError(f"the shm KV transport needs a writable {SHM_DIR}")


def choose(setting: str, peer_probe: str | None) -> KVTransport:
    """The transport for a pull from a peer: shared memory when this worker finds the peer's
    probe (see shm_probe) in its own /dev/shm, else TCP."""
    if setting == "auto":
        setting = "shm" if sees_shm_probe(peer_probe) else "tcp"
    return transport_named(setting)
