"""The ranks' rendezvous, behind the cluster's key: a key-value store the driver serves over an
authenticated connection (the same key as the rank connections), in place of torch's TCPStore,
which answers anyone who reaches its port.

torch.distributed takes any `Store`; the gloo and NCCL groups use it only to swap addresses and
ids at startup, so a small server with a thread per rank is plenty."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Client, Connection

import torch.distributed as dist

from shoal.engine.parallel.auth_listener import AuthListener


class StoreServer:
    """The driver's side: keys in a dict, one thread per connected rank."""

    def __init__(self, host: str, port: int, authkey: bytes):
        self.listener = AuthListener(host, port, authkey)
        self.address = self.listener.address
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._closed = False
        threading.Thread(target=self._accept, name="shoal-rendezvous", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):
            self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    op, *args = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply = ("ok", getattr(self, f"_op_{op}")(*args))
                except Exception as exc:
                    reply = ("error", f"{type(exc).__name__}: {exc}")
                try:
                    conn.send(reply)
                except OSError:
                    return

    def _wait_for(self, keys: list[str], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._changed.wait(min(left, 1.0))
        return True

    def _op_set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    def _op_get(self, key: str, timeout_s: float) -> bytes:
        if not self._wait_for([key], timeout_s):
            raise TimeoutError(f"rendezvous key {key!r} not set within {timeout_s:.0f} s")
        return self._data[key]

    def _op_add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def _op_append(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = self._data.get(key, b"") + value
            self._changed.notify_all()

    def _op_compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._changed:
            current = self._data.get(key)
            if (current is None and not expected) or current == expected:
                self._data[key] = desired
                self._changed.notify_all()
                return desired
            return current if current is not None else expected

    def _op_wait(self, keys: list[str], timeout_s: float) -> None:
        if not self._wait_for(keys, timeout_s):
            raise TimeoutError(f"rendezvous keys {keys} not set within {timeout_s:.0f} s")

    def _op_check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._data for k in keys)

    def _op_delete_key(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def _op_num_keys(self) -> int:
        with self._changed:
            return len(self._data)


class AuthStore(dist.Store):
    """A rank's side: every call is a request to the driver's StoreServer."""

    def __init__(self, host: str, port: int, authkey: bytes, timeout: timedelta):
        super().__init__()
        self._where = (host, port, authkey)
        self._conn = Client((host, port), authkey=authkey)
        self._lock = threading.Lock()
        self._timeout_s = timeout.total_seconds()

    def _call(self, op: str, *args):
        with self._lock:
            self._conn.send((op, *args))
            status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"rendezvous {op}: {value}")
        return value

    def set(self, key, value) -> None:
        self._call("set", key, _bytes(value))

    def get(self, key) -> bytes:
        return self._call("get", key, self._timeout_s)

    def add(self, key, amount) -> int:
        return self._call("add", key, int(amount))

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call("compare_set", key, _bytes(expected), _bytes(desired))

    def wait(self, keys, timeout=None) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else self._timeout_s
        self._call("wait", list(keys), seconds)

    def check(self, keys) -> bool:
        return self._call("check", list(keys))

    def delete_key(self, key) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def set_timeout(self, timeout) -> None:
        self._timeout_s = timeout.total_seconds()

    def clone(self) -> AuthStore:
        """Another client of the same store (gloo gives each of its connection threads one)."""
        return AuthStore(*self._where, timedelta(seconds=self._timeout_s))

    def multi_get(self, keys) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys, values) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def append(self, key, value) -> None:
        self._call("append", key, _bytes(value))

    def has_extended_api(self) -> bool:
        return True


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
