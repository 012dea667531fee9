"""Collectives among a stage's tensor-parallel ranks, and hidden states between pipeline stages.

Ranks on one host sum (and gather, and trade a mixture of experts' tokens) through shared memory
(shoal/kernels/shm_comm.c: microseconds per decode step's all-reduce, where gloo takes ~0.5 ms);
ranks on several hosts, or sums of tensors that are not float32, go through torch.distributed
(gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import secrets
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shoal.kernels.abi import ShmCommState
from shoal.kernels.build import load_shm_library

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 1 << 20  # per rank and buffer; larger tensors go through in slices of this


class CommError(RuntimeError):
    """A collective failed (a peer died or hung): this rank's group can no longer be used."""


class TorchCommunicator:
    """torch.distributed collectives on a process group."""

    kind = "torch"  # what a rank reports it sums through

    def __init__(self, group, world_size: int):
        self.group = group
        self.world_size = world_size
        self._busy_ns = 0
        self._calls = 0

    @property
    def busy(self) -> tuple[int, int]:
        """(nanoseconds spent in collectives, calls) so far: the communication profile."""
        return self._busy_ns, self._calls

    def all_reduce(self, t: torch.Tensor) -> None:
        t0 = time.perf_counter_ns()
        dist.all_reduce(t, group=self.group)
        self._busy_ns += time.perf_counter_ns() - t0
        self._calls += 1

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        out = torch.empty((self.world_size, *t.shape), dtype=t.dtype, device=t.device)
        dist.all_gather(list(out.unbind(0)), t.contiguous(), group=self.group)
        self._busy_ns += time.perf_counter_ns() - t0
        self._calls += 1
        return out

    def all_to_all(self, t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """rows [world, world] (the same on every rank): rank s sends rank d rows[s, d] rows. `t`
        holds this rank's sends by destination, in rank order; returns what every rank sent this
        one, by source in rank order."""
        t0 = time.perf_counter_ns()
        me = dist.get_rank(self.group)
        recv = rows[:, me].tolist()
        out = t.new_empty((sum(recv), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv, rows[me].tolist(), group=self.group)
        self._busy_ns += time.perf_counter_ns() - t0
        self._calls += 1
        return out

    def native(self) -> tuple[int, int] | None:
        return None

    @property
    def failed(self) -> bool:
        return False

    def close(self) -> None:
        pass


class ShmCommunicator(TorchCommunicator):
    """Shared-memory collectives for float32 CPU tensors; anything else goes through the group."""

    kind = "shm"

    def __init__(self, group, world_size: int, rank: int, name: str, timeout_s: float):
        super().__init__(group, world_size)
        lib = load_shm_library()
        if lib is None:
            raise CommError("the shared-memory collectives did not build (no C compiler)")
        lib.shoal_shm_bytes.restype = ctypes.c_int64
        lib.shoal_shm_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
        lib.shoal_shm_allreduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        lib.shoal_shm_allgather.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.shoal_shm_alltoall.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.lib = lib
        size = lib.shoal_shm_bytes(world_size, SLOT_BYTES)
        path = SHM_DIR / name
        # Rank 0 creates the mapping, everyone opens it, then it is unlinked: nothing is left in
        # /dev/shm whatever happens to the processes later.
        if rank == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
            os.close(fd)
        dist.barrier(group=group)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        dist.barrier(group=group)
        if rank == 0:
            path.unlink()
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.state = ShmCommState(rank, world_size, base, SLOT_BYTES, 0, timeout_s, 0, 0, 0)
        self._fn = ctypes.cast(lib.shoal_shm_allreduce, ctypes.c_void_p).value

    @property
    def failed(self) -> bool:
        return bool(self.state.failed)

    @property
    def busy(self) -> tuple[int, int]:
        own_ns, own_calls = super().busy  # tensors that went through the group
        return own_ns + self.state.busy_ns, own_calls + self.state.calls

    def native(self) -> tuple[int, int]:
        """(function, state) pointers for C code that calls the all-reduce itself."""
        return self._fn, ctypes.addressof(self.state)

    def _check(self, rc: int) -> None:
        if rc:
            raise CommError(
                f"a tensor-parallel peer did not join a collective within {self.state.timeout_s:g} s"
            )

    def all_reduce(self, t: torch.Tensor) -> None:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            return super().all_reduce(t)
        self._check(self.lib.shoal_shm_allreduce(ctypes.byref(self.state), t.data_ptr(), t.numel()))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return super().all_gather(t)
        t = t.contiguous()
        out = torch.empty((self.world_size, *t.shape), dtype=t.dtype)
        nbytes = t.numel() * t.element_size()
        self._check(
            self.lib.shoal_shm_allgather(ctypes.byref(self.state), t.data_ptr(), nbytes, out.data_ptr())
        )
        return out

    def all_to_all(self, t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return super().all_to_all(t, rows)
        t = t.contiguous()
        row_bytes = math.prod(t.shape[1:]) * t.element_size()
        sizes = (rows.to(torch.int64) * row_bytes).contiguous()
        out = t.new_empty((int(rows[:, self.state.rank].sum()), *t.shape[1:]))
        state = ctypes.byref(self.state)
        self._check(self.lib.shoal_shm_alltoall(state, t.data_ptr(), sizes.data_ptr(), out.data_ptr()))
        return out

    def close(self) -> None:
        """Nothing to undo: the mapping is unlinked already and goes with the process (it cannot be
        closed while the C state points into it)."""


def tp_communicator(group, world_size: int, rank: int, name: str, device: torch.device, timeout_s: float):
    """Shared memory where every rank of the group is on CPU and sees the same /dev/shm, else the
    group's own collectives."""
    hosts: list = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if device.type == "cpu" and load_shm_library() is not None and _share_shm(group, world_size):
        return ShmCommunicator(group, world_size, rank, name, timeout_s)
    log.info("tensor-parallel collectives through torch.distributed (hosts %s, %s)", hosts, device)
    return TorchCommunicator(group, world_size)


def _share_shm(group, world_size: int) -> bool:
    """Whether every rank of the group sees every other's /dev/shm files: a probe, not the host
    name (two hosts can share a name, and containers on one host can have their own /dev/shm).
    Each rank writes a file of its own, and every rank must find all of them."""
    token = secrets.token_hex(16)
    probe = SHM_DIR / f"shoal-probe-{token}"
    try:
        probe.write_text(token)
    except OSError:
        token = ""
    tokens: list = [None] * world_size
    dist.all_gather_object(tokens, token, group=group)
    sees = all(t and _reads(SHM_DIR / f"shoal-probe-{t}", t) for t in tokens)
    verdicts: list = [None] * world_size
    dist.all_gather_object(verdicts, sees, group=group)  # every probe is read before any goes
    if token:
        probe.unlink(missing_ok=True)
    return all(verdicts)


def _reads(path: Path, expected: str) -> bool:
    try:
        return path.read_text() == expected
    except OSError:
        return False


class StageLink:
    """Hidden states from one pipeline stage to the next: each tensor-parallel rank of a stage sends
    to its counterpart in the next. Sends are asynchronous, so a stage goes on to its next batch
    while the next stage still works on this one."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, hidden: int, dtype, device):
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.hidden, self.dtype, self.device = hidden, dtype, device
        self._pending: list = []  # (work, tensor): sends in flight, tensors kept alive until done
        self.wait_ns = 0  # time spent waiting for the previous stage: the pipeline's bubbles

    def recv(self, rows: int) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        t = torch.empty((rows, self.hidden), dtype=self.dtype, device=self.device)
        dist.recv(t, src=self.prev_rank)
        self.wait_ns += time.perf_counter_ns() - t0
        return t

    def send(self, t: torch.Tensor) -> None:
        self._pending = [(w, x) for w, x in self._pending if not w.is_completed()]
        t = t.contiguous()
        self._pending.append((dist.isend(t, dst=self.next_rank), t))

    def flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []
