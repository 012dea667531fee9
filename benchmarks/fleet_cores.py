"""A fleet on one host against one replica alone, on the same cores (issue 25, defect 7): the
README's `shoal fleet up --replicas 2` through its gateway against `shoal serve`, both with their
default flags, under the same load: 32-token prompts, 128 greedy tokens, 8 concurrent streams.
Before the fleet shared the host's cores, each replica took every core and two replicas on two
cores served 0.11x of one alone; the target is at least 0.75x.

It prints output tok/s, the ratio, and where the CPU went while each ran: the replicas, the
gateway, this script's own load generator, everything else on the host, and idle (shares of the
host's cores over the measured window). With `--oversubscribed`, a third run gives each replica
every core (`--cores-per-replica` = all), as the fleet did before.

    python benchmarks/fleet_cores.py [--requests 32] [--rounds 2] [--concurrency 8] [--oversubscribed]

The targets run side by side and are measured in turns (serve, fleet, serve, fleet, ...), so that
a drifting background load on a shared host falls on each alike; idle targets' CPU is shown.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import tempfile
import time

import httpx
from fleet_process import FleetProcess  # this script's folder is on sys.path

from shoal.bench.serve import ServeBenchConfig, run_serve_bench_async
from shoal.fleet.cores import host_cpus
from shoal.fleet.launcher import free_port

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
        """Each party's share of the cores' time over the window (they sum to about 1)."""
        wall = time.monotonic() - self.t0
        capacity = wall * len(host_cpus())
        out = {}
        for k, pids in self.parties.items():
            out[k] = (sum(cpu_seconds(p) for p in pids) - self.start[k]) / capacity
        out["load generator"] = (client_seconds() - self.client0) / capacity
        busy, idle = host_busy_idle()
        out["others on the host"] = max(0.0, (busy - self.busy0) / capacity - sum(out.values()))
        out["idle"] = (idle - self.idle0) / capacity
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
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def load(url: str, a: argparse.Namespace, requests: int, seed: int) -> dict:
    cfg = ServeBenchConfig(
        base_url=url,
        num_requests=requests,
        input_len=a.input_len,
        output_len=a.output_len,
        max_concurrency=a.concurrency,
        seed=seed,
    )
    return asyncio.run(run_serve_bench_async(cfg))


class Target:
    """One way of serving, started once and measured in turns with the others (the host is shared,
    so its background load drifts: turns put every target under the same drift)."""

    def __init__(self, name: str, url: str, parties: dict[str, list[int]], stop, cores=None):
        self.name, self.url, self.parties, self.stop, self.cores = name, url, parties, stop, cores
        self.runs: list[dict] = []

    def measure(self, a: argparse.Namespace, others: dict[str, list[int]]) -> dict:
        window = CpuWindow({**self.parties, **others})
        summary = load(self.url, a, a.requests, seed=2 + len(self.runs))
        assert summary["failed"] == 0, summary["errors"]
        run = {"tok_s": summary["output_token_throughput"], "cpu": window.shares()}
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
    p.add_argument("--requests", type=int, default=32, help="per measured turn")
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
            load(t.url, a, a.concurrency, seed=1)  # warm-up: kernels tuned, pools and connections made
        for _ in range(a.rounds):
            for t in targets:
                idle = {
                    "idle targets": [
                        p for o in targets if o is not t for ps in o.parties.values() for p in ps
                    ]
                }
                t.measure(a, idle)
    finally:
        for t in targets:
            t.stop()
    report(a, targets, ncores)


def report(a: argparse.Namespace, targets: list[Target], ncores: int) -> None:
    base = targets[0]
    print(
        f"\n{ncores} cores; turns of {a.requests} requests, {a.input_len} prompt tokens and "
        f"{a.output_len} greedy tokens each, {a.concurrency} streams at once; {a.rounds} turns each"
    )
    parties = ["replicas", "gateway", "load generator", "idle targets", "others on the host", "idle"]
    print(f"{'':30} {'tok/s':>7} {'ratio':>6}  " + " ".join(f"{x[:12]:>12}" for x in parties))
    for t in targets:
        tok_s = median([r["tok_s"] for r in t.runs])
        # The ratio turn by turn (each against the one-replica turn just before it), then the median.
        ratio = median([r["tok_s"] / b["tok_s"] for r, b in zip(t.runs, base.runs)])
        cpu = " ".join(f"{100 * median([r['cpu'].get(x, 0.0) for r in t.runs]):>11.0f}%" for x in parties)
        print(f"{t.name:30} {tok_s:>7.1f} {ratio:>5.2f}x  {cpu}")
        print(f"{'':30} turns: " + ", ".join(f"{r['tok_s']:.0f}" for r in t.runs) + " tok/s")
        if t.cores:
            print(f"{'':30} replicas' cores: {t.cores}")
    print("CPU: shares of the cores' time over each turn (medians); 'others' is the rest of the host.")


if __name__ == "__main__":
    main()
