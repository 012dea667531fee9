"""The KV-event log the fleet's router polls: sequence numbers, paging, and a reset for a poller
that fell behind what the log still holds."""

from __future__ import annotations

from shoal.engine.block_pool import KVEvent
from shoal.engine.kv_event_log import KVEventLog


def test_a_poller_pages_through_events_and_one_left_behind_is_told_to_reset():
    log = KVEventLog(max_events=4, block_size=16)
    assert log.since(0) == {
        "instance": log.instance_id,
        "block_size": 16,
        "reset": False,
        "next": 0,
        "events": [],
    }
    log.extend([KVEvent("stored", h, h - 1 if h > 1 else None) for h in range(1, 4)])
    first = log.since(0, limit=2)
    assert first["next"] == 2 and not first["reset"]
    assert [e["block_hash"] for e in first["events"]] == [1, 2]
    assert first["events"][1] == {"kind": "stored", "block_hash": 2, "parent_hash": 1}
    rest = log.since(first["next"])
    assert [e["block_hash"] for e in rest["events"]] == [3] and rest["next"] == 3
    assert log.since(3)["events"] == [] and log.since(3)["next"] == 3  # caught up

    log.extend([KVEvent("removed", h) for h in (1, 2, 3)])  # 6 events; the log keeps the last 4
    late = log.since(1)  # event 2 was dropped: this poller's index is stale
    assert late["reset"] and [e["kind"] for e in late["events"]] == [
        "stored",
        "removed",
        "removed",
        "removed",
    ]
    assert not log.since(2)["reset"]  # it saw everything up to what the log still holds
    assert KVEventLog(4, 16).instance_id != log.instance_id  # a restarted replica is a new instance
