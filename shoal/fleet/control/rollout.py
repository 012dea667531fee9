"""A rolling update of one pool: its replicas move to a new version (model or replica flags) one at a
time, without going dark. Each step starts one replica of the new version beside the old ones (a
surge of one); when it has loaded it takes traffic and one old replica drains. With a canary
share, the first new replica gets that share of the pool's requests for `canary_s` before the
rest follow. A new replica that dies, fails to load, or is not ready within `ready_timeout_s`
rolls the pool back, and so does a new version that fails far more of its requests than the old
one, or is far slower to its first token or between tokens (canary_judge.py; judged throughout the
update, the canary's hold included): the previous version becomes the target again and whatever
runs the failed one is replaced the same way. The last judgement's figures (both versions' error
rates and p99s) are logged with the decision, exported on /metrics and shown on the status page."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field

from shoal.fleet.admission.canary import CanarySplit
from shoal.fleet.config import ModelConfig
from shoal.fleet.control.canary_judge import CanaryConfig, counts, judge, tally, window_start
from shoal.fleet.control.replica_set import Lifecycle, Pool, ReplicaSet, Slot
from shoal.fleet.metrics import GatewayMetrics
from shoal.fleet.proxy.shadow import Shadow
from shoal.fleet.replicas.table import ReplicaTable

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    previous: ModelConfig  # what the pool ran before, for a rollback
    previous_version: int
    canary: float = 0.0  # share of requests the first new replica takes while it is watched
    canary_s: float = 30.0
    ready_timeout_s: float = 300.0
    started: float = 0.0
    canary_since: float | None = None
    shadow_since: float | None = None  # the first new replica, loaded, began taking shadow copies
    rolling_back: bool = False
    judging: CanaryConfig = field(default_factory=CanaryConfig)
    # The old version's replicas' (finished, failed) requests when it began, by name.
    baseline: dict[str, tuple[int, int]] = field(default_factory=dict)
    judgement: dict = field(default_factory=dict)  # the last comparison's figures, new and old


def failed(slot: Slot, rep, now: float, timeout: float) -> str | None:
    """Why a replica of the new version counts as failed, if it does."""
    if slot.restarts:
        return f"{slot.name} died"
    if rep is not None and rep.note and '"failed"' in rep.note:
        return f"{slot.name} failed to load: {rep.note[:200]}"
    if slot.state == Lifecycle.STARTING and now - slot.started_at > timeout:
        return f"{slot.name} not ready after {timeout:.0f} s"
    return None


class RolloutDriver:
    """Moves a pool's slots to its target version; the controller calls `step` each tick."""

    def __init__(
        self,
        replica_set: ReplicaSet,
        table: ReplicaTable,
        canary: CanarySplit,
        shadow: Shadow,
        metrics: GatewayMetrics,
        ready_timeout_s: float,
        judging: CanaryConfig,
    ):
        self.rs = replica_set
        self.table = table
        self.canary = canary
        self.shadow = shadow  # copies of requests for the new version, while one is judged
        self.metrics = metrics
        self.ready_timeout_s = ready_timeout_s
        self.judging = judging  # when the new version's failed requests roll it back

    def begin(
        self,
        pool: Pool,
        model: ModelConfig,
        canary: float,
        canary_s: float,
        now: float,
        shadow: float | None = None,
    ) -> None:
        """`shadow`: the share of requests copied to the new version (None: as configured)."""
        r = Rollout(pool.model, pool.version, canary, canary_s, self.ready_timeout_s, now)
        r.judging = self.judging if shadow is None else dataclasses.replace(self.judging, shadow=shadow)
        reps = self.table.replicas
        r.baseline = {s.name: counts(reps[s.name]) for s in pool.slots if s.name in reps}
        pool.rollout, pool.model = r, model
        pool.version += 1
        if r.judging.shadow:
            self.shadow.start(model.name, pool.key, pool.version, r.judging.shadow)
        log.warning(
            "rolling update of %s to version %d (canary %.0f %%)", pool.key, pool.version, 100 * canary
        )

    def step(self, pool: Pool, now: float) -> None:
        r = pool.rollout
        current = [s for s in pool.slots if s.version == pool.version and s.state != Lifecycle.STOPPED]
        old = [s for s in pool.slots if s.version != pool.version]  # stopped ones: until they exit
        if not r.rolling_back:
            for s in current:
                why = failed(s, self.table.replicas.get(s.name), now, r.ready_timeout_s)
                if why:
                    return self._roll_back(pool, why)
            why = self._failing(pool, r, current, old)
            if why:
                return self._roll_back(pool, why)
        if r.canary_since is not None and now - r.canary_since < r.canary_s:
            return  # the canary is being watched
        self.canary.stop(pool.model.name)
        if not [s for s in old if s.state not in (Lifecycle.DRAINING, Lifecycle.STOPPED)]:
            if not old:
                self._finish(pool)
            return
        loaded = [s for s in current if s.state == Lifecycle.STANDBY]
        old_ready = [s for s in old if s.state == Lifecycle.READY]
        old_spare = [s for s in old if s.state in (Lifecycle.STANDBY, Lifecycle.STARTING)]
        if old_spare:  # spares of the old version are simply replaced (the pool refills them)
            for s in old_spare:
                self.rs.stop_slot(s, "replaced by the new version")
            return
        if loaded and old_ready and r.judging.shadow and not r.rolling_back:
            if r.shadow_since is None:  # the first new replica is judged on copies before traffic
                r.shadow_since = now
                log.warning(
                    "%s: version %d takes shadow copies for %.0f s", pool.key, pool.version, r.canary_s
                )
            if now - r.shadow_since < r.canary_s:
                return
        if loaded and old_ready:
            new, gone = loaded[0], old_ready[0]
            self.rs.set_state(new, Lifecycle.READY, f"version {pool.version}")
            self.rs.set_state(gone, Lifecycle.DRAINING, f"replaced by version {pool.version}")
            if r.canary and r.canary_since is None and not r.rolling_back and len(old_ready) > 1:
                r.canary_since = now
                self.canary.start(pool.model.name, pool.version, r.canary)
            return
        starting = [s for s in current if s.state == Lifecycle.STARTING and s.surge]
        if not starting and not loaded:
            slot = self.rs.new_slot(pool)
            slot.surge = True
            self.rs.start_slot(slot, now)

    def _failing(self, pool: Pool, r: Rollout, current: list[Slot], old: list[Slot]) -> str | None:
        """Why the new version serves worse than the old one, if it does."""
        reps = self.table.replicas
        new_reps = [reps[s.name] for s in current if s.name in reps]
        old_reps = [reps[s.name] for s in old if s.name in reps]
        # Errors count from the update's start; latency over one window for both versions.
        opens = window_start(new_reps, r.started, r.judging.warmup_s)
        start = opens if opens is not None else float("inf")
        new, before = tally(new_reps, start=start), tally(old_reps, r.baseline, start)
        why = judge(new, before, r.judging)
        if not old_reps:  # the old version is gone: its last comparison is the one that stands
            return why
        r.judgement = {"new": new.figures(), "old": before.figures(), "verdict": why}
        for version, t in (("new", new), ("old", before)):
            self.metrics.rollout_error_rate.labels(pool.key, version).set(t.rate)
            for gauge, value in (
                (self.metrics.rollout_ttft_p99, t.ttft_p99),
                (self.metrics.rollout_itl_p99, t.itl_p99),
            ):
                if value is not None:
                    gauge.labels(pool.key, version).set(value)
        return why

    def _roll_back(self, pool: Pool, why: str) -> None:
        r = pool.rollout
        log.warning(
            "rolling update of %s failed (%s); rolling back to version %d; figures: %s",
            pool.key,
            why,
            r.previous_version,
            json.dumps(r.judgement),
        )
        r.judgement["verdict"] = why
        pool.last_judgement = {**r.judgement, "decision": "rolled_back"}
        self.metrics.rollouts.labels(pool.key, "rolled_back").inc()
        self.canary.stop(pool.model.name)
        self.shadow.stop(pool.model.name)
        pool.model, pool.version = r.previous, r.previous_version
        r.rolling_back, r.canary_since = True, None
        for s in pool.slots:
            if s.version != pool.version and s.state in (Lifecycle.STARTING, Lifecycle.STANDBY):
                self.rs.stop_slot(s, "its version was rolled back")

    def _finish(self, pool: Pool) -> None:
        r = pool.rollout
        outcome = "rolled_back" if r.rolling_back else "done"
        if not r.rolling_back:
            self.metrics.rollouts.labels(pool.key, outcome).inc()
            pool.last_judgement = {**r.judgement, "decision": "promoted"}
        log.warning(
            "rolling update of %s: %s at version %d; figures: %s",
            pool.key,
            outcome,
            pool.version,
            json.dumps(pool.last_judgement),
        )
        self.shadow.stop(pool.model.name)
        pool.rollout = None
        pool.last_rollout = outcome
        for s in pool.slots:
            s.surge = False
