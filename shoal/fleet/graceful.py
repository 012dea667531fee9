"""The gateway's HTTP server: SIGTERM (or a first Ctrl-C) stops it taking connections and lets the
requests in flight finish within `shutdown_timeout_s`; then the fleet stops its replicas and the
process exits 0 (uvicorn would raise the signal again and die of it, leaving buffered spans
unsent). A second Ctrl-C cuts the wait short."""

from __future__ import annotations

import signal

import uvicorn


class GracefulServer(uvicorn.Server):
    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
