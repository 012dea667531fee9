"""The model's files for a rank whose host lacks them: the driver sends them over the rank's
authenticated connection, and the rank keeps them in its cache, so a host that starts with shoal
installed and no model can still take a rank (and the next start on it reads the cache).

A copy is named by the driver's file stamps (path, sizes, modification times); each file's SHA-256
is computed on both ends as it streams, and a copy is used only once every digest matched."""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class ModelFiles:
    """What the driver loads: a GGUF file, or a checkpoint directory (its top-level files)."""

    path: str
    stamp: str  # changes whenever a file does
    is_dir: bool = False  # a checkpoint directory (else one file)

    @classmethod
    def of(cls, path: Path) -> ModelFiles:
        h = hashlib.sha256(str(path.resolve()).encode())
        for f in _files(path):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        return cls(str(path), h.hexdigest()[:32], path.is_dir())

    def cached(self, cache_root: Path) -> Path:
        """Where a rank keeps its copy (complete once its marker is there)."""
        return cache_root / "fetched" / self.stamp / Path(self.path).name


def send(conn: Connection, path: Path) -> None:
    """Streams every file: (name, size), its chunks, an empty chunk, its SHA-256; then (None, 0)."""
    for f in _files(path):
        conn.send((f.name, f.stat().st_size))
        digest = hashlib.sha256()
        with open(f, "rb") as src:
            while chunk := src.read(CHUNK_BYTES):
                digest.update(chunk)
                conn.send_bytes(chunk)
        conn.send_bytes(b"")
        conn.send(digest.hexdigest())
    conn.send((None, 0))


def receive(conn: Connection, files: ModelFiles, cache_root: Path) -> Path:
    """Takes what `send` streams into the cache; returns the local path to load."""
    target = files.cached(cache_root)
    partial = target.parent / (target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    while True:
        name, size = conn.recv()
        if name is None:
            break
        if "/" in name or name.startswith("."):
            raise ValueError(f"the driver sent a file named {name!r}")
        digest, got = hashlib.sha256(), 0
        with open(partial / name, "wb") as out:
            while chunk := conn.recv_bytes():
                digest.update(chunk)
                out.write(chunk)
                got += len(chunk)
        if conn.recv() != digest.hexdigest() or got != size:
            raise ValueError(f"{name} arrived damaged ({got} of {size} bytes, or a digest mismatch)")
    if target.exists():  # another rank on this host got there first
        shutil.rmtree(partial, ignore_errors=True)
        return target
    if files.is_dir:
        partial.rename(target)
    else:
        (partial / target.name).rename(target)
        shutil.rmtree(partial, ignore_errors=True)
    return target


def local_copy(files: ModelFiles, cache_root: Path) -> Path | None:
    """The model as this host has it: the driver's own path, or a complete cached copy."""
    if Path(files.path).exists():
        return Path(files.path)
    target = files.cached(cache_root)
    return target if target.exists() else None


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(f for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
