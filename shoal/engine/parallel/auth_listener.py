"""A listener for the cluster's own connections: each peer proves it holds the key before it is
handed over, and each proof runs on a thread of its own with a deadline, so that a stranger that
connects and says nothing holds up nobody (multiprocessing's Listener proves peers one at a time,
inside accept)."""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

HANDSHAKE_TIMEOUT_S = 10.0


class AuthListener:
    def __init__(self, host: str, port: int, authkey: bytes):
        self.sock = socket.create_server((host, port), backlog=64)
        self.address = self.sock.getsockname()[:2]
        self.authkey = authkey
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._accept, name="shoal-auth-accept", daemon=True).start()

    def accept(self, timeout: float | None = None) -> Connection:
        """The next peer that proved the key; raises queue.Empty after `timeout`, OSError once
        closed."""
        conn = self._ready.get(timeout=timeout)
        if conn is None:
            raise OSError("the listener is closed")
        return conn

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
        self._ready.put(None)

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._prove, args=(sock,), daemon=True).start()

    def _prove(self, sock: socket.socket) -> None:
        # A receive timeout on the descriptor itself: the Connection reads it in blocking mode.
        timeval = struct.pack("ll", int(HANDSHAKE_TIMEOUT_S), 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except Exception:  # a wrong key, garbage, or silence past the deadline
            conn.close()
            return
        fd = socket.socket(fileno=conn.fileno())
        try:  # a proven peer may stay quiet as long as it likes
            fd.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
            fd.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 0))
        finally:
            fd.detach()
        if self._closed:
            conn.close()
        else:
            self._ready.put(conn)
