"""How a local fleet shares the host's cores among its replicas (shoal.fleet.control.cores): the per-replica
figure from the replicas the fleet may run at once, disjoint cores while they last, then the least
shared ones (or none, when told to wait), and cores that come back when a replica exits. The real
fleet's processes are checked in test_fleet_processes.py."""

from __future__ import annotations

import pytest

from shoal.fleet.config import FleetConfig, ModelConfig, load_fleet_config
from shoal.fleet.control.cores import CoreAllocator, CoresConfig, planned_replicas, thread_env, threads_flag


def test_two_replicas_on_two_cores_get_one_core_each():
    cores = CoreAllocator.for_fleet(CoresConfig(), 2, cpus=[0, 1])
    a, b = cores.acquire(), cores.acquire()
    assert (a.cpus, b.cpus, a.threads, b.threads) == ([0], [1], 1, 1)
    assert cores.capacity == 2


def test_the_figure_counts_every_replica_the_fleet_may_run():
    # An autoscaled pool counts at its maximum plus its standbys; a disaggregated model its workers.
    models = [
        ModelConfig(name="a", min_replicas=0, max_replicas=3, warm_standby=1),
        ModelConfig(name="b", prefill=1, decode=2),
    ]
    assert planned_replicas(models) == 4 + 3
    assert planned_replicas(FleetConfig(replicas=2).model_configs()) == 2
    assert CoreAllocator.for_fleet(CoresConfig(gateway=0), 7, cpus=list(range(16))).per_replica == 2
    assert CoreAllocator.for_fleet(CoresConfig(per_replica=3), 7, cpus=list(range(16))).per_replica == 3


def test_a_large_host_keeps_a_core_for_the_gateway():
    cores = CoreAllocator.for_fleet(CoresConfig(), 2, cpus=list(range(8)))
    assert cores.cpus == list(range(1, 8)) and cores.per_replica == 3
    assert CoreAllocator.for_fleet(CoresConfig(), 2, cpus=[0, 1]).cpus == [0, 1]  # a small one does not


def test_replicas_get_neighbouring_cores_and_give_them_back():
    cores = CoreAllocator(list(range(4)), 2)
    a, b = cores.acquire(), cores.acquire()
    assert (a.cpus, b.cpus) == ([0, 1], [2, 3])
    a.release()
    a.release()  # once only
    assert cores.acquire().cpus == [0, 1]
    assert sorted(cores.holders.values()) == [1, 1, 1, 1]


def test_past_the_cores_replicas_share_the_least_shared_ones():
    cores = CoreAllocator([0, 1], 1, "share")
    leases = [cores.acquire() for _ in range(5)]
    assert [lease.cpus for lease in leases] == [[0], [1], [0], [1], [0]]
    assert [lease.shared for lease in leases] == [False, False, True, True, True]
    assert thread_env(1, shared=True)["OMP_WAIT_POLICY"] == "PASSIVE"  # no spinning on a shared core
    assert "OMP_WAIT_POLICY" not in thread_env(1)
    assert cores.has_room()
    leases[1].release()
    assert cores.acquire().cpus == [1]  # the core fewest replicas hold


def test_when_told_to_wait_no_replica_starts_past_the_cores():
    cores = CoreAllocator([0, 1], 1, "wait")
    a = cores.acquire()
    assert cores.has_room()
    cores.acquire()
    assert not cores.has_room()
    a.release()
    assert cores.has_room()


def test_an_explicit_thread_count_takes_that_many_cores():
    assert threads_flag(["--kv-cache-memory", "1GiB", "--threads", "2"]) == 2
    assert threads_flag(["--threads=3"]) == 3
    assert threads_flag(["--quantization", "int8"]) is None
    cores = CoreAllocator(list(range(4)), 1)
    assert cores.acquire(threads_flag(["--threads", "2"])).cpus == [0, 1]
    assert thread_env(2)["OMP_NUM_THREADS"] == "2"


def test_cores_config_from_toml_and_checked(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text('replicas = 2\n[cores]\nper_replica = 1\ncpus = [0, 1]\nwhen_full = "wait"\n')
    cfg = load_fleet_config(path)
    assert (cfg.cores.per_replica, cfg.cores.cpus, cfg.cores.when_full) == (1, [0, 1], "wait")
    path.write_text('[cores]\nwhen_full = "squeeze"\n')
    with pytest.raises(ValueError, match="when_full"):
        load_fleet_config(path)
