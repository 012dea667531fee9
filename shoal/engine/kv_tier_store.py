"""The bytes of the KV offload tiers, beside one runner's KV pools: a host-memory array of blocks
and a folder of block files, moved as the scheduler's tier index orders (kv_tiers.py).

Disk writes run on a thread of their own, so a step does not wait for the disk to save a block
it demoted; a later read or delete of that block waits for its write. The folder is this
process's own (made at start, removed at shutdown): the index that names its files lives only
as long as the process, and a start removes the folders of processes that died without doing so."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from shoal.engine.kv_tiers import TierMove
from shoal.protocol.kv_files import pid_alive

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class KVTierStore:
    def __init__(self, kv_caches: KVCaches, block_size: int, host_blocks: int, disk_root: str | None):
        self.kv_caches = kv_caches
        self.block_size = block_size
        k0 = kv_caches[0][0]
        self.shape = (len(kv_caches), 2, block_size, *k0.shape[1:])  # one block: [layers, K/V, tokens, ...]
        self.dtype = k0.dtype
        pin = k0.device.type == "cuda"
        self.host = torch.empty((host_blocks, *self.shape), dtype=self.dtype, pin_memory=pin)
        self.folder: Path | None = None
        self._writer: ThreadPoolExecutor | None = None
        if disk_root is not None:
            Path(disk_root).mkdir(parents=True, exist_ok=True)
            sweep_dead_folders(Path(disk_root))
            self.folder = Path(tempfile.mkdtemp(prefix=f"shoal-kv-{os.getpid()}-", dir=disk_root))
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk")
        self._pending: dict[int, Future] = {}  # block hash -> its write in flight

    def apply(self, moves: list[TierMove]) -> None:
        for m in moves:
            if m.kind == "save":
                self.host[m.host_slot].copy_(self._read_block(m.block_id))
            elif m.kind == "save_disk":
                self._write_file(m.block_hash, self._read_block(m.block_id).cpu())
            elif m.kind == "demote":
                self._write_file(m.block_hash, self.host[m.host_slot].clone())
            elif m.kind == "drop":
                self._wait(m.block_hash)
                self._path(m.block_hash).unlink(missing_ok=True)
            elif m.kind == "load_host":
                self._write_block(m.block_id, self.host[m.host_slot])
            elif m.kind == "load_disk":
                self._write_block(m.block_id, self._read_file(m.block_hash))
            else:
                raise ValueError(f"unknown tier move {m.kind!r}")

    def time_loads(self, repeats: int) -> dict[str, float]:
        """Median seconds to load one block into the pool from each tier this store has, with pool
        block 0 and host slot 0 as scratch: only before any request runs."""
        costs = {}
        if self.host.shape[0]:
            costs["host"] = _median(lambda: self._write_block(0, self.host[0]), repeats)
        if self.folder is not None:
            scratch = 0  # no block of a real prompt has it (its chance: one in 2**64)
            self._write_file(scratch, self._read_block(0).cpu())
            costs["disk"] = _median(lambda: self._write_block(0, self._read_file(scratch)), repeats)
            self._path(scratch).unlink(missing_ok=True)
        return costs

    def read(self, tier: str, ref: int) -> torch.Tensor:
        """One block's K/V ([layers, 2, block_size, ...]) from host slot `ref` or the disk file of
        hash `ref`."""
        return self.host[ref] if tier == "host" else self._read_file(ref)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _rows(self, block_id: int) -> slice:
        return slice(block_id * self.block_size, (block_id + 1) * self.block_size)

    def _read_block(self, block_id: int) -> torch.Tensor:
        rows = self._rows(block_id)
        return torch.stack([torch.stack([k[rows], v[rows]]) for k, v in self.kv_caches])

    def _write_block(self, block_id: int, data: torch.Tensor) -> None:
        rows = self._rows(block_id)
        data = data.to(self.kv_caches[0][0].device, non_blocking=True)
        for layer, (k, v) in enumerate(self.kv_caches):
            k[rows] = data[layer, 0]
            v[rows] = data[layer, 1]

    def _path(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash:016x}.kv"

    def _write_file(self, block_hash: int, data: torch.Tensor) -> None:
        raw = data.contiguous().view(torch.uint8).numpy()
        self._wait(block_hash)
        self._pending[block_hash] = self._writer.submit(raw.tofile, self._path(block_hash))

    def _read_file(self, block_hash: int) -> torch.Tensor:
        self._wait(block_hash)
        raw = np.fromfile(self._path(block_hash), dtype=np.uint8)
        return torch.from_numpy(raw).view(self.dtype).reshape(self.shape)

    def _wait(self, block_hash: int) -> None:
        write = self._pending.pop(block_hash, None)
        if write is not None:
            write.result()


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # one to warm up
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def sweep_dead_folders(root: Path) -> None:
    """Removes the tier folders under `root` whose process is gone (killed, say)."""
    for folder in root.glob("shoal-kv-*-*"):
        pid = folder.name.split("-")[2]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
