"""The shared-memory collectives between real processes: exact sums in rank order, slices larger
than one slot, all-gather, all-to-all of uneven sizes (against gloo's), and a peer that never
arrives."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shoal.engine.parallel.comm import SLOT_BYTES, CommError, ShmCommunicator, TorchCommunicator
from shoal.kernels.build import load_shm_library
from tests.server_helpers import free_port

pytestmark = pytest.mark.skipif(load_shm_library() is None, reason="no C compiler")

WORLD = 3
# Rows rank s sends rank d, by case: uneven, some none, and one that takes several slots (the
# largest sender's share decides how many every rank takes part in).
TRADES = {
    "uneven": [[1, 0, 4], [3, 2, 0], [0, 5, 1]],
    "none": [[0, 0, 0], [0, 0, 0], [0, 0, 0]],
    "slots": [[0, 700, 3], [9, 0, 0], [1, 2, 0]],
}
WIDTH = {"uneven": 7, "none": 7, "slots": 1024}


def _sent(rank: int, dest: int, rows: int, width: int) -> torch.Tensor:
    """What `rank` sends `dest`: its rows tell both apart."""
    base = 1000 * rank + 10 * dest
    return base + torch.arange(rows * width, dtype=torch.float32).view(rows, width) / (rows * width + 1)


def _inputs(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(rank))


def _collectives(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    comm = ShmCommunicator(dist.group.WORLD, WORLD, rank, f"shoal-test-{port}", timeout_s=3.0)
    big = SLOT_BYTES // 4 * 2 + 123  # three slices of a slot, the last one short
    for n in (576, big):
        t = _inputs(rank, n)
        for _ in range(3):  # back-to-back calls reuse the two buffers in turn
            x = t.clone()
            comm.all_reduce(x)
        results[("sum", rank, n)] = x
    results[("gather", rank)] = comm.all_gather(torch.full((5, 7), float(rank)))
    gloo = TorchCommunicator(dist.group.WORLD, WORLD)
    for case, trades in TRADES.items():
        rows, width = torch.tensor(trades), WIDTH[case]
        sends = torch.cat([_sent(rank, d, n, width) for d, n in enumerate(trades[rank])])
        results[("a2a", case, rank)] = (comm.all_to_all(sends, rows), gloo.all_to_all(sends, rows))
    if rank != 2:  # rank 2 stays out of it: the others' next all-reduce must give up, not hang
        t0 = time.monotonic()
        try:
            comm.all_reduce(torch.ones(8))
            results[("timeout", rank)] = None
        except CommError:
            results[("timeout", rank)] = time.monotonic() - t0
        results[("failed", rank)] = comm.failed
    # Every rank leaves gloo together: a rank that returned with its group still up was aborted at
    # exit once in a full run ("terminate called without an active exception": SIGABRT).
    dist.barrier()
    dist.destroy_process_group()


def test_shared_memory_collectives_between_processes():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_collectives, args=(free_port(), results), nprocs=WORLD)
        results = dict(results)
    for n in (576, SLOT_BYTES // 4 * 2 + 123):
        want = _inputs(0, n) + _inputs(1, n) + _inputs(2, n)  # rank order, as every rank sums
        for rank in range(WORLD):
            assert torch.equal(results[("sum", rank, n)], want)  # the same bits everywhere
    for rank in range(WORLD):
        gathered = results[("gather", rank)]
        assert gathered.shape == (WORLD, 5, 7)
        assert [float(g[0, 0]) for g in gathered] == [0.0, 1.0, 2.0]
    for case, trades in TRADES.items():
        for rank in range(WORLD):
            want = torch.cat([_sent(s, rank, trades[s][rank], WIDTH[case]) for s in range(WORLD)])
            shm, gloo = results[("a2a", case, rank)]
            assert torch.equal(shm, want) and torch.equal(gloo, want), (case, rank)
    assert max(sum(r) for r in TRADES["slots"]) * WIDTH["slots"] * 4 > SLOT_BYTES
    for rank in (0, 1):
        assert results[("timeout", rank)] is not None and 2.5 < results[("timeout", rank)] < 10
        assert results[("failed", rank)]
