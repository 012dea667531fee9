"""The gateway's HTTP server: SIGTERM (or a first Ctrl-C) stops it taking connections and lets the
requests in flight finish within `shutdown_timeout_s`; then the fleet stops its replicas and the
process exits 0 (uvicorn would raise the signal again and die of it, leaving buffered spans
unsent). A second Ctrl-C cuts the wait short."""

from __future__ import annotations

import signal
import socket

import uvicorn


def bind_listener(host: str, port: int) -> socket.socket | None:
    """The gateway's port, bound before anything else of the fleet picks a free port (a replica's
    free port is any the kernel has free: the gateway's too, were it not held yet); None when it is
    taken. Port 0: any free one (the socket says which)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind does
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


class GracefulServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
