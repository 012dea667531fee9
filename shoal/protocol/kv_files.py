"""Where K/V handed between workers on one host waits: files in shared memory, named so that a
name from the wire can only ever point at one of them, and so that what a killed worker leaves
behind can be found (by its supervisor, or the next worker to start) and removed."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "shoal-kv-"
# Names a peer may ask this worker to read: our prefix, the writer's pid (so that what a killed
# worker leaves behind can be found and removed) and 128 random bits; a name from the wire can
# never point at another file.
SHM_NAME = re.compile(r"shoal-kv-(\d{1,10})-[0-9a-f]{32}")
# A worker's probe of who shares its /dev/shm (engine.kv_connector.transports.shm_probe): not K/V,
# named apart from it, and swept like it once its writer is gone.
PROBE_PREFIX = "shoal-probe-"
PROBE_NAME = re.compile(r"shoal-probe-(\d{1,10})-[0-9a-f]{32}")


def new_name(prefix: str = SHM_PREFIX) -> str:
    return f"{prefix}{os.getpid()}-{secrets.token_hex(16)}"


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def shm_unlink(name: str) -> None:
    if SHM_NAME.fullmatch(name) or PROBE_NAME.fullmatch(name):
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid runs on this host (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shm_sweep(pid: int | None = None) -> int:
    """Removes the K/V files of a worker that died holding them (of `pid`, or of every writer that
    is gone); returns how many."""
    if not SHM_DIR.is_dir():
        return 0
    removed = 0
    for path in [*SHM_DIR.glob(SHM_PREFIX + "*"), *SHM_DIR.glob(PROBE_PREFIX + "*")]:
        m = SHM_NAME.fullmatch(path.name) or PROBE_NAME.fullmatch(path.name)
        if m is None:
            continue
        writer = int(m.group(1))
        if writer == pid or (pid is None and not pid_alive(writer)):
            shm_unlink(path.name)
            removed += 1
    return removed
