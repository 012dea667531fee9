"""A fleet on one host against one replica alone, on the same cores (issue 25, defect 7): the
README's `shoal fleet up --replicas 2` through its gateway against `shoal serve`, both with their
default flags, under the same load: 8 streams back to back, each a 32-token prompt and 128 greedy
tokens. Before the fleet shared the host's cores, each replica took every core and two replicas on
two cores served 0.11x of one alone; the target is at least 0.75x.

The targets run side by side and are measured in turns (serve, fleet, serve, fleet, ...), so that
a drifting background load on a shared host falls on each alike. A turn lets its streams settle,
then counts the tokens that arrive in a fixed window (each chunk carries its token ids). It prints
output tok/s, the ratio to one replica, tokens per CPU-second of the target's own processes (less
swayed by what else runs on the host), and where the cores' time went over the window: the
replicas, the gateway, this script's load generator, the idle targets, the rest of the host, idle.
With `--oversubscribed`, a third target gives each replica every core, as the fleet did before.

On a host that others load, run it with OMP_WAIT_POLICY=passive (both targets inherit it): with
OpenMP's default spinning, the lone 2-thread `shoal serve` collapses whenever one of its threads
is descheduled (3 tok/s against 128 with passive waits, same host, same minute), which says more
about the neighbours than about the fleet. The fleet's 1-thread replicas have no barrier to spin at.

    OMP_WAIT_POLICY=passive python benchmarks/fleet_cores.py [--window 20] [--rounds 2] [--oversubscribed]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

import httpx
from fleet_process import FleetProcess, stop_process  # this script's folder is on sys.path

from shoal.fleet.control.cores import host_cpus
from shoal.fleet.control.launchers.local import free_port

MODEL = "SmolLM2-135M-Instruct"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process, seconds (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def host_busy_idle() -> tuple[float, float]:
    """Busy and idle CPU-seconds of this host's cores that this process may use, since boot."""
    mine = {f"cpu{c}" for c in host_cpus()}
    busy = idle = 0.0
    with open("/proc/stat") as f:
        for line in f:
            name, *vals = line.split()
            if name in mine:
                v = [int(x) for x in vals[:8]]
                idle += (v[3] + v[4]) / TICKS  # idle, iowait
                busy += (sum(v) - v[3] - v[4]) / TICKS
    return busy, idle


def client_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class CpuWindow:
    """CPU by party over one measured window: {party: pids} read at the start and at the end."""

    def __init__(self, parties: dict[str, list[int]]):
        self.parties = parties
        self.t0 = time.monotonic()
        self.start = {k: sum(cpu_seconds(p) for p in pids) for k, pids in parties.items()}
        self.busy0, self.idle0 = host_busy_idle()
        self.client0 = client_seconds()

    def shares(self) -> dict[str, float]:
        """Each party's share of the cores' time since the start (they sum to about 1), and
        "own cpu_s": the CPU-seconds of the measured target's own processes."""
        wall = time.monotonic() - self.t0
        capacity = wall * len(host_cpus())
        out = {}
        for k, pids in self.parties.items():
            out[k] = (sum(cpu_seconds(p) for p in pids) - self.start[k]) / capacity
        out["load generator"] = (client_seconds() - self.client0) / capacity
        busy, idle = host_busy_idle()
        out["others on the host"] = max(0.0, (busy - self.busy0) / capacity - sum(out.values()))
        out["idle"] = (idle - self.idle0) / capacity
        out["own cpu_s"] = (out.get("replicas", 0.0) + out.get("gateway", 0.0)) * capacity
        return out


class ServeProcess:
    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="shoal-bench-serve-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shoal.cli", "serve", "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited; see {self.log_path}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready; see {self.log_path}")

    def stop(self) -> None:
        stop_process(self.proc)


async def stream_tokens(url: str, a: argparse.Namespace, start: float, end: float) -> int:
    """Streams of `a.concurrency` clients, back to back, from now until `end`: the tokens that
    arrived in [start, end] (each chunk says its token ids, so merged deltas count right)."""
    rng = random.Random(7)
    counted = 0

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal counted
        while time.monotonic() < end:
            body = {
                "model": MODEL,
                "prompt": [rng.randrange(1000, 40000) for _ in range(a.input_len)],
                "max_tokens": a.output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200, (r.status_code, await r.aread())
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.monotonic()
                    if now > end:
                        return
                    if now >= start:
                        choices = json.loads(line[6:])["choices"]
                        counted += sum(len(ch.get("token_ids") or []) for ch in choices)

    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=a.concurrency)) as c:
        await asyncio.gather(*(client(c) for _ in range(a.concurrency)))
    return counted


class Target:
    """One way of serving, started once and measured in turns with the others."""

    def __init__(self, name: str, url: str, parties: dict[str, list[int]], stop, cores=None):
        self.name, self.url, self.parties, self.stop, self.cores = name, url, parties, stop, cores
        self.runs: list[dict] = []

    def warm(self, a: argparse.Namespace) -> None:
        """Kernels tuned, pools and connections made, before any turn counts."""
        asyncio.run(stream_tokens(self.url, a, float("inf"), time.monotonic() + a.settle))

    def measure(self, a: argparse.Namespace, others: dict[str, list[int]]) -> dict:
        """One turn: streams start, settle for `a.settle` s, then `a.window` s are counted."""
        start = time.monotonic() + a.settle
        end = start + a.window

        async def cpu_over_window() -> dict[str, float]:
            await asyncio.sleep(max(0.0, start - time.monotonic()))
            window = CpuWindow({**self.parties, **others})
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            return window.shares()

        async def turn():
            return await asyncio.gather(stream_tokens(self.url, a, start, end), cpu_over_window())

        tokens, cpu = asyncio.run(turn())
        run = {"tok_s": tokens / a.window, "tok_per_cpu_s": tokens / max(cpu["own cpu_s"], 1e-9), "cpu": cpu}
        self.runs.append(run)
        return run


def start_serve() -> Target:
    server = ServeProcess()
    server.wait_ready()
    pids = [server.proc.pid, *descendants(server.proc.pid)]
    return Target("shoal serve (one replica)", server.url, {"replicas": pids}, server.stop)


def start_fleet(name: str, extra: list[str]) -> Target:
    fleet = FleetProcess(["--replicas", "2", *extra], "")
    fleet.wait_ready(2)
    parties = {"replicas": descendants(fleet.proc.pid), "gateway": [fleet.proc.pid]}
    cores = httpx.get(fleet.url + "/replicas", timeout=10).json()["pools"][0]["cores"]
    return Target(name, fleet.url, parties, fleet.stop, cores)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=float, default=20.0, help="seconds counted per turn")
    p.add_argument("--settle", type=float, default=4.0, help="seconds of streaming before a window")
    p.add_argument("--rounds", type=int, default=2, help="turns of each target")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--oversubscribed", action="store_true", help="also: every replica on every core")
    a = p.parse_args()
    ncores = len(host_cpus())
    targets: list[Target] = []
    try:
        targets.append(start_serve())
        targets.append(start_fleet("shoal fleet up --replicas 2", []))
        if a.oversubscribed:
            targets.append(start_fleet("  each on every core", ["--cores-per-replica", str(ncores)]))
        for t in targets:
            t.warm(a)
        for _ in range(a.rounds):
            for t in targets:
                idle = [p for o in targets if o is not t for pids in o.parties.values() for p in pids]
                t.measure(a, {"idle targets": idle})
    finally:
        for t in targets:
            t.stop()
    report(a, targets, ncores)


def report(a: argparse.Namespace, targets: list[Target], ncores: int) -> None:
    base = targets[0]
    print(
        f"\n{ncores} cores; {a.concurrency} streams of {a.input_len} prompt and {a.output_len} greedy "
        f"tokens; {a.rounds} turns each of {a.window:.0f} s counted"
    )
    parties = ["replicas", "gateway", "load generator", "idle targets", "others on the host", "idle"]
    print(
        f"{'':28} {'tok/s':>6} {'ratio':>6} {'tok/cpu-s':>9} {'ratio':>6}  "
        + " ".join(f"{x[:10]:>10}" for x in parties)
    )
    for t in targets:
        tok_s = median([r["tok_s"] for r in t.runs])
        per_cpu = median([r["tok_per_cpu_s"] for r in t.runs])
        # Ratios turn by turn (each against the one-replica turn of its round), then the median.
        ratio = median([r["tok_s"] / b["tok_s"] for r, b in zip(t.runs, base.runs)])
        cpu_ratio = median([r["tok_per_cpu_s"] / b["tok_per_cpu_s"] for r, b in zip(t.runs, base.runs)])
        cpu = " ".join(f"{100 * median([r['cpu'].get(x, 0.0) for r in t.runs]):>9.0f}%" for x in parties)
        print(f"{t.name:28} {tok_s:>6.1f} {ratio:>5.2f}x {per_cpu:>9.1f} {cpu_ratio:>5.2f}x  {cpu}")
        print(f"{'':28} turns: " + ", ".join(f"{r['tok_s']:.0f}" for r in t.runs) + " tok/s")
        if t.cores:
            print(f"{'':28} replicas' cores: {t.cores}")
    print("CPU: shares of the cores' time over each window (medians); 'others' is the rest of the host.")


if __name__ == "__main__":
    main()
