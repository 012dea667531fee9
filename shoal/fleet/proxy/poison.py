"""Poison requests: a request that takes replicas down must not be handed from one to the next.

Every request present when its replica died gets a strike against its fingerprint (path and
canonical body, less how it streams), kept for `poison_ttl_s`. The rule, per death:

- It was struck before (this death is its second): poison. So a request is continued or re-run
  after a replica's death at most once: a kill -9 from outside costs an innocent request nothing,
  a request that kills whatever serves it kills at most two replicas.
- The death was a crash (the replica said its engine died under the request, or its process
  exited on its own rather than by a signal) and the request is the prime suspect: the only
  request in flight there, or the only one that had not produced a token yet (crashes strike when
  a request is first scheduled; one that has streamed for a while is unlikely the cause): poison
  at once, so it kills only the one replica.
- Else (a kill, a freeze, a crash with other suspects): continue elsewhere, once.

A replica that was unreachable (its connects timed out: a partition) and comes back as the same
process did not die: the strikes that death gave are withdrawn (`absolve`), so a request that lived
through a partition and then a real death is continued after both.

A poison request fails once with 500 `poison_request`, and the same fingerprint is then refused
at the door until the strike expires: a client's automatic retries are cheap and kill nothing.
A request the replica failed on its own (`internal_error`: the engine isolated it and went on) is
not retried either, and is struck, so that a second such failure also convicts it.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from shoal.fleet.replicas.replica import Death
from shoal.protocol.errors import EXIT_RANK_LOST, APIError

# Exit by these signals is someone ending the process; anything else it did itself.
KILL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
MAX_ENTRIES = 100_000


# Fields that change how an answer travels, not what the engine runs.
TRANSPORT_FIELDS = frozenset({"stream", "stream_options", "return_token_ids", "user"})


def fingerprint(path: str, body: dict) -> str:
    """The request as the engine sees it: streamed or not, it is the same poison."""
    engine_part = {k: v for k, v in body.items() if k not in TRANSPORT_FIELDS}
    canonical = json.dumps(engine_part, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{path}\0{canonical}".encode("utf-8", "surrogatepass")).hexdigest()


def crashed(death: Death, reported_engine_dead: bool) -> bool:
    """Whether the replica failed by itself (vs. killed or frozen from outside)."""
    if reported_engine_dead or death.engine_dead:
        return True
    code = death.exit_code
    if code == EXIT_RANK_LOST:  # one of its ranks died or hung: like a kill from outside
        return False
    return code is not None and (code >= 0 or -code not in KILL_SIGNALS)


def poison_error(message: str) -> APIError:
    return APIError(500, message, code="poison_request")


@dataclass
class _Entry:
    strikes: int
    expires: float
    convicted: bool = False
    deaths: set = field(default_factory=set)  # the deaths that struck it: one strike each


class PoisonGuard:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def _live(self, fp: str) -> _Entry | None:
        e = self._entries.get(fp)
        if e is not None and e.expires < time.monotonic():
            del self._entries[fp]
            return None
        return e

    @property
    def active(self) -> bool:
        """Whether any fingerprint is held (else requests need not be fingerprinted at all)."""
        while self._entries:
            fp, e = next(iter(self._entries.items()))
            if e.expires >= time.monotonic():
                return True
            del self._entries[fp]
        return False

    def refused(self, fp: str) -> float:
        """Seconds for which this fingerprint is still refused, or 0."""
        e = self._live(fp)
        return max(0.0, e.expires - time.monotonic()) if e is not None and e.convicted else 0.0

    def strike(self, fp: str) -> int:
        e = self._live(fp) or _Entry(0, 0.0)
        e.strikes += 1
        e.expires = time.monotonic() + self.ttl_s
        self._entries[fp] = e
        self._entries.move_to_end(fp)
        while len(self._entries) > MAX_ENTRIES:
            self._entries.popitem(last=False)
        return e.strikes

    def convict(self, fp: str) -> None:
        e = self._live(fp)
        if e is None:
            self.strike(fp)
            e = self._entries[fp]
        e.convicted = True
        e.expires = time.monotonic() + self.ttl_s

    def absolve(self, death: Death) -> None:
        """`death` was no death (its replica came back as the same process): the strikes it gave
        are withdrawn, unless they already convicted."""
        key = (id(death), death.at)
        for fp, e in list(self._entries.items()):
            if key in e.deaths and not e.convicted:
                e.deaths.discard(key)
                e.strikes -= 1
                if e.strikes <= 0:
                    del self._entries[fp]

    def judge(self, fp: str, death: Death, attempt, engine_dead: bool) -> bool:
        """Strikes the request for `death`; True when it is poison now (see the module doc).
        Identical requests in one death (a client's burst of the same prompt) share one strike."""
        key = (id(death), death.at)
        e = self._live(fp)
        if e is not None and key in e.deaths:
            return e.convicted
        strikes = self.strike(fp)
        self._entries[fp].deaths.add(key)
        if strikes >= 2:
            self.convict(fp)
            return True
        if crashed(death, engine_dead) and _prime_suspect(death, attempt):
            self.convict(fp)
            return True
        return False


def _prime_suspect(death: Death, attempt) -> bool:
    suspects = death.suspects or frozenset({attempt})
    if attempt not in suspects:
        return False
    if len(suspects) == 1:
        return True
    fresh = [a for a in suspects if a.tokens == 0]
    return fresh == [attempt]
