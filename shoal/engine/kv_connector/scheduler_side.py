"""The KV connector's scheduler side: how many of a request's tokens arrive from outside (their
K/V computed by another engine), and which finished requests keep their blocks for a handoff.

A prefill worker's request asks to hold its K/V (`hold_kv`): when it finishes normally its blocks
stay allocated until the decode worker has taken them (`release`), or until nobody has within a
timeout (`expired`; the taker died, or never came). The scheduler frees the blocks of whatever
this side lets go; the blocks themselves are the KV cache manager's."""

from __future__ import annotations

import time

from shoal.engine.request import Request, RequestStatus

# A request that ends any other way (aborted, failed) has no K/V worth handing over.
_HANDED_OVER = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)


class KVConnectorScheduler:
    def __init__(self):
        self.held: dict[str, Request] = {}
        self._held_since: dict[str, float] = {}
        self._newly_held: set[str] = set()  # held, not yet taken by take_newly_held

    @property
    def num_held(self) -> int:
        return len(self.held)

    def num_external_tokens(self, req: Request) -> int:
        """The prompt tokens whose K/V arrives with the request instead of being computed here."""
        return req.external_kv.num_tokens if req.external_kv is not None else 0

    def take_external(self, req: Request):
        """The arriving K/V's data, for the step that first runs the request. Taken once: a
        request preempted later computes its prompt like any other."""
        data = req.external_kv.data if req.external_kv is not None else None
        req.external_kv = None
        return data

    def request_finished(self, req: Request) -> bool:
        """True when the finished request's blocks must stay for a handoff (until `release`)."""
        if not (req.hold_kv and req.status in _HANDED_OVER):
            return False
        self.held[req.request_id] = req
        self._held_since[req.request_id] = time.monotonic()
        self._newly_held.add(req.request_id)
        return True

    def take_newly_held(self) -> list[str]:
        """The requests held since the last call and still held."""
        taken, self._newly_held = sorted(self._newly_held), set()
        return taken

    def release(self, request_id: str) -> Request | None:
        """The held request whose blocks may now be freed (its K/V was taken, or is unwanted)."""
        self._held_since.pop(request_id, None)
        self._newly_held.discard(request_id)
        return self.held.pop(request_id, None)

    def expired(self, timeout_s: float) -> list[str]:
        """Held requests nobody took within timeout_s."""
        now = time.monotonic()
        return [rid for rid, since in self._held_since.items() if now - since > timeout_s]
