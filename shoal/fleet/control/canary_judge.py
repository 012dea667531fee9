"""Whether a rolling update's new version serves worse than the old one: fails more requests, or
is slower to the first token or between tokens.

A new version can load, pass every probe and never die, and still fail what it is sent (a flag
that sheds every request, a model that errors in every step), or serve it several times slower
(weights left unquantized, a batch cap set too low). The gateway fails failed requests over, so
clients may not see it, but promoting that version would leave nothing to fail over to. So while
an update runs, what the new version's replicas served is compared with what the old version's
served over the same window (since the update began), and the update rolls back when:

- errors: the new version finished at least `min_requests`, failed at least `max_error_rate` of
  them, and more than `error_rate_ratio` times the old version's share (a fleet shedding load
  under a burst, old and new alike, is not rolled back for it). A failed request is any 5xx, a
  stream broken by its replica, or no answer in time; a 4xx is the client's.
- latency: over the same window for both versions, from `warmup_s` after the new version's
  first token (a process's first steps are slow, and the update's own start and moves load the
  host), with at least `min_ttft_samples` first tokens and `min_itl_samples` gaps on each side:
  the new version's p99 time to first token is more than `max_ttft_p99_ratio` times the old's, or
  its p99 gap between tokens more than `max_itl_p99_ratio` times; either must also exceed the
  old by `min_slowdown_s`, so that noise on a fast, idle fleet does not count.

The gateway measures both (replicas/latency.py): from sending a request to a replica to its first
token, and between the tokens it relays. Sending the canary its share is admission/canary.py's
part, shadow copies shadow.py's; this module only judges, for the rollout (control/rollout.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.fleet.replicas.latency import p99, since


@dataclass
class CanaryConfig:
    """When a rolling update rolls back (`[rollout]`; `[canary]` is the older name)."""

    min_requests: int = 20  # finished by the new version before its error rate is judged
    warmup_s: float = 5.0  # latency: the new version's first seconds of traffic are left out
    min_ttft_samples: int = 30  # first tokens on each side before TTFT is judged
    min_itl_samples: int = 200  # gaps between tokens on each side before ITL is judged
    max_error_rate: float = 0.2  # the new version's failed share must reach this ...
    error_rate_ratio: float = 2.0  # ... and be more than this many times the old version's
    max_ttft_p99_ratio: float = 1.5  # new p99 TTFT past this many times the old's rolls back
    max_itl_p99_ratio: float = 1.5  # the same for the gap between tokens
    min_slowdown_s: float = 0.05  # ... and only when it is at least this much slower
    shadow: float = 0.0  # share of requests also sent to the new version, compared and discarded

    def check(self) -> None:
        if self.min_requests < 1 or not 0 < self.max_error_rate <= 1 or self.error_rate_ratio < 1:
            raise ValueError(
                "rollout: need min_requests >= 1, 0 < max_error_rate <= 1, error_rate_ratio >= 1"
            )
        if min(self.min_ttft_samples, self.min_itl_samples) < 1 or self.warmup_s < 0:
            raise ValueError("rollout: need min_ttft_samples >= 1, min_itl_samples >= 1, warmup_s >= 0")
        if self.max_ttft_p99_ratio < 1 or self.max_itl_p99_ratio < 1 or self.min_slowdown_s < 0:
            raise ValueError(
                "rollout: need max_ttft_p99_ratio >= 1, max_itl_p99_ratio >= 1, min_slowdown_s >= 0"
            )
        if not 0 <= self.shadow <= 1:
            raise ValueError("rollout: need 0 <= shadow <= 1")


@dataclass
class Tally:
    """What one version's replicas served over a window: requests finished and failed, and the
    latency samples the gateway took of them."""

    requests: int = 0
    failed: int = 0
    ttft: tuple[float, ...] = ()
    itl: tuple[float, ...] = ()

    @property
    def rate(self) -> float:
        return self.failed / self.requests if self.requests else 0.0

    @property
    def ttft_p99(self) -> float | None:
        return p99(list(self.ttft))

    @property
    def itl_p99(self) -> float | None:
        return p99(list(self.itl))

    def figures(self) -> dict:
        """For the log, /metrics and the status page."""
        return {
            "requests": self.requests,
            "failed": self.failed,
            "error_rate": round(self.rate, 4),
            "ttft_p99_s": self.ttft_p99,
            "itl_p99_s": self.itl_p99,
            "ttft_samples": len(self.ttft),
            "itl_samples": len(self.itl),
        }

    def __str__(self) -> str:
        return f"{self.failed} of {self.requests} requests ({100 * self.rate:.0f} %)"


def counts(replica) -> tuple[int, int]:
    """(finished, failed) requests of a table Replica over its life (one the gateway abandoned
    before it had an outcome there is neither)."""
    return replica.requests_total - replica.inflight - replica.abandoned_total, replica.failed_total


def tally(replicas, since_counts: dict[str, tuple[int, int]] | None = None, start: float = 0.0) -> Tally:
    """The requests `replicas` finished and failed, less what each had at `since_counts` (by
    name; a replica whose counts went back has restarted since, and counts from zero), and their
    latency samples from `start` on."""
    t = Tally()
    windows = []
    for r in replicas:
        done, failed = counts(r)
        done0, failed0 = (since_counts or {}).get(r.name, (0, 0))
        if done < done0 or failed < failed0:
            done0 = failed0 = 0
        t.requests += done - done0
        t.failed += failed - failed0
        windows.append(r.latency)
    t.ttft, t.itl = tuple(since(windows, "ttft", start)), tuple(since(windows, "itl", start))
    return t


def window_start(new_replicas, since_s: float, warmup_s: float) -> float | None:
    """Where the latency window opens: `warmup_s` after the new version's first sample since
    `since_s` (None: it has none yet)."""
    windows = [w for r in new_replicas for w in (r.latency.ttft, r.latency.itl)]
    first = min((next((t for t, _ in w if t >= since_s), math.inf) for w in windows), default=math.inf)
    return first + warmup_s if first < math.inf else None


def judge(new: Tally, old: Tally, config: CanaryConfig) -> str | None:
    """Why the new version must roll back, or None (not, or not known yet)."""
    if (
        new.requests >= config.min_requests
        and new.rate >= config.max_error_rate
        and new.rate > config.error_rate_ratio * old.rate  # else the load, not the version
    ):
        return f"the new version failed {new} against {old} for the old"
    bars = (
        ("ttft", config.max_ttft_p99_ratio, config.min_ttft_samples),
        ("itl", config.max_itl_p99_ratio, config.min_itl_samples),
    )
    for kind, ratio, enough in bars:
        samples_new, samples_old = getattr(new, kind), getattr(old, kind)
        if min(len(samples_new), len(samples_old)) < enough:
            continue
        slow, fast = p99(list(samples_new)), p99(list(samples_old))
        if slow > ratio * fast and slow - fast >= config.min_slowdown_s:
            name = "time to first token" if kind == "ttft" else "time between tokens"
            return (
                f"the new version's p99 {name} is {slow:.3f} s against {fast:.3f} s for the old "
                f"({slow / fast:.1f}x, over {len(samples_new)} and {len(samples_old)} samples; "
                f"the limit is {ratio:g}x)"
            )
    return None
