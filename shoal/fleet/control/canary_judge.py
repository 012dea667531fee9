"""Whether a rolling update's new version fails requests far more than the old one does.

A new version can load, pass every probe and never die, and still fail what it is sent: a flag
that sheds every request (a 503), a model that errors in every step (a 500 per request, the engine
going on), a front that breaks every stream. The gateway fails such requests over, so clients may
not see it, but promoting that version would leave nothing to fail over to. So while an update
runs, the requests relayed to the new version's replicas are tallied against those relayed to the
old version's since the update began, and the update rolls back when the new version has finished
enough requests to judge (`min_requests`), fails at least `max_error_rate` of them, and fails more
than `error_rate_ratio` times the old version's share (so that a fleet shedding load under a burst,
old and new alike, is not rolled back for it). A failed request is any 5xx, a stream broken by
its replica, or no answer in time; a 4xx is the client's. The SLO-gated canary (latency) is not
this: here only failures count. Sending the canary its share of requests is another part's
(admission/canary.py, CanarySplit); this one only judges, for the rollout (control/rollout.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CanaryConfig:
    """When a rolling update rolls back for the requests its new version fails (`[canary]`)."""

    min_requests: int = 20  # finished by the new version before its error rate is judged
    max_error_rate: float = 0.2  # the new version's failed share must reach this ...
    error_rate_ratio: float = 2.0  # ... and be more than this many times the old version's

    def check(self) -> None:
        if self.min_requests < 1 or not 0 < self.max_error_rate <= 1 or self.error_rate_ratio < 1:
            raise ValueError("canary: need min_requests >= 1, 0 < max_error_rate <= 1, error_rate_ratio >= 1")


@dataclass
class Tally:
    """Requests finished and failed by one version's replicas over a window."""

    requests: int = 0
    failed: int = 0

    @property
    def rate(self) -> float:
        return self.failed / self.requests if self.requests else 0.0

    def __str__(self) -> str:
        return f"{self.failed} of {self.requests} requests ({100 * self.rate:.0f} %)"


def counts(replica) -> tuple[int, int]:
    """(finished, failed) requests of a table Replica over its life."""
    return replica.requests_total - replica.inflight, replica.failed_total


def tally(replicas, since: dict[str, tuple[int, int]] | None = None) -> Tally:
    """The requests `replicas` finished and failed, less what each had at `since` (by name; a
    replica whose counts went back has restarted since, and counts from zero)."""
    t = Tally()
    for r in replicas:
        done, failed = counts(r)
        done0, failed0 = (since or {}).get(r.name, (0, 0))
        if done < done0 or failed < failed0:
            done0 = failed0 = 0
        t.requests += done - done0
        t.failed += failed - failed0
    return t


def judge(new: Tally, old: Tally, config: CanaryConfig) -> str | None:
    """Why the new version must roll back for its failures, or None (not, or not known yet)."""
    if new.requests < config.min_requests or new.rate < config.max_error_rate:
        return None
    if new.rate <= config.error_rate_ratio * old.rate:
        return None  # the old version fails about as much: the load, not the version
    return f"the new version failed {new} against {old} for the old"
