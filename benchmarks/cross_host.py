"""Tensor and pipeline parallelism and the P/D K/V handoff across hosts made of network namespaces
(shoal.testing.hosts: each host its own address, hostname and /dev/shm, joined by a bridge whose
links `tc tbf` can slow), against one process, in one run.

For TP=2 and PP=2 it prints decode output tok/s at concurrency 1 and 8 and the ranks' time in
collectives (TP) or waiting for the previous stage (PP) per output token: ranks on one host
(shared memory), on two hosts at full link speed, at 1 Gbit/s and at 100 Mbit/s. For P/D it prints,
by prompt length, the prefill time on host A against the time host B takes to pull the K/V over
TCP, at full speed and at 1 Gbit/s. Needs root (it skips with the reason otherwise).

    sudo python benchmarks/cross_host.py [--tokens 64] [--lengths 128,512,1024] [--quantization auto]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time

import httpx

from shoal import SamplingParams
from shoal.engine.parallel.worker import AUTHKEY_ENV
from shoal.llm import LLM
from shoal.protocol.secrets import KV_TRANSFER_KEY_ENV, KV_TRANSFER_KEY_HEADER
from shoal.testing.hosts import Cluster, ClusterConfig, available

PROMPT_LEN = 32
KEY = secrets.token_hex(16)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def split_llm(cluster: Cluster | None, hosts: list[int], quantization: str, **split):
    """An engine split over ranks on `hosts` (the driver here), or one process without a cluster."""
    if cluster is None:
        with LLM(quantization=quantization, num_blocks=1024, **split) as llm:
            yield llm
        return
    address = cluster.gateway_address
    port = free_port(address)
    env = {**os.environ, AUTHKEY_ENV: KEY}
    cmd = [sys.executable, "-m", "shoal.cli", "worker", "--driver", f"{address}:{port}"]
    procs = [
        cluster.hosts[h].run(
            [*cmd, "--rank", str(r)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for r, h in enumerate(hosts)
    ]
    os.environ[AUTHKEY_ENV] = KEY
    try:
        opts = dict(launch_workers=False, distributed_host=address, distributed_port=port)
        with LLM(quantization=quantization, num_blocks=1024, **opts, **split) as llm:
            yield llm
    finally:
        del os.environ[AUTHKEY_ENV]
        for p in procs:
            p.kill()
            p.wait()


def decode_rate(llm: LLM, concurrency: int, tokens: int) -> tuple[float, float | None]:
    """(output tok/s, seconds per output token the ranks spent in collectives or stage waits)."""
    prompts = [[1000 + 37 * i + j for j in range(PROMPT_LEN)] for i in range(concurrency)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
    before = llm.engine.stats().ranks
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    after = llm.engine.stats().ranks
    out = concurrency * tokens
    if not after:
        return out / elapsed, None
    waits = [(a.comm_s + a.stage_wait_s) - (b.comm_s + b.stage_wait_s) for a, b in zip(after, before)]
    return out / elapsed, sum(waits) / len(waits) / out


def limited(cluster: Cluster, hosts: list[int], rate: str | None):
    for h in set(hosts):
        cluster.hosts[h].limit(rate)


def parallel_rows(cluster: Cluster, quantization: str, tokens: int) -> None:
    print("\n| split | ranks | link | c=1 tok/s | c=8 tok/s | collectives or stage wait per token (c=8) |")
    print("| --- | --- | --- | --- | --- | --- |")
    with split_llm(None, [], quantization) as llm:
        one = decode_rate(llm, 1, tokens)[0], decode_rate(llm, 8, tokens)[0]
    print(f"| none | one process | - | {one[0]:.1f} | {one[1]:.1f} | - |")
    for name, split in (("TP=2", {"tensor_parallel_size": 2}), ("PP=2", {"pipeline_parallel_size": 2})):
        for where, hosts, rate in (
            ("one host", [0, 0], None),
            ("two hosts", [0, 1], None),
            ("two hosts", [0, 1], "1gbit"),
            ("two hosts", [0, 1], "100mbit"),
        ):
            limited(cluster, hosts, rate)
            try:
                with split_llm(cluster, hosts, quantization, **split) as llm:
                    c1, _ = decode_rate(llm, 1, tokens)
                    c8, wait = decode_rate(llm, 8, tokens)
            finally:
                limited(cluster, hosts, None)
            wait_s = f"{1000 * wait:.2f} ms" if wait is not None else "-"
            print(f"| {name} | {where} | {rate or 'full'} | {c1:.1f} | {c8:.1f} | {wait_s} |")


PULL = """
import sys, time, httpx
url, handle, header, key = sys.argv[1:5]
t0 = time.perf_counter()
r = httpx.post(url + "/kv/pull", json={"handle": handle, "transport": "tcp"},
               headers={header: key}, timeout=120)
r.raise_for_status()
print(time.perf_counter() - t0, len(r.content))
"""


def pd_rows(cluster: Cluster, quantization: str, lengths: list[int]) -> None:
    """Prefill on host 0 (timed from here), the K/V pulled by a client on host 1 over TCP."""
    prefill = cluster.hosts[0]
    port = 8300
    env = {**os.environ, KV_TRANSFER_KEY_ENV: KEY}
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--role", "prefill", "--host", prefill.address]
    proc = prefill.run([*cmd, "--port", str(port), "--quantization", quantization, "--max-model-len", "4096"],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://{prefill.address}:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the prefill worker did not come up")
            time.sleep(0.5)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        print("\n| prompt tokens | K/V MiB | prefill on A | pull by B, full link | pull by B, 1 Gbit/s |")
        print("| --- | --- | --- | --- | --- |")
        for n in lengths:
            row = []
            for rate in (None, "1gbit"):
                limited(cluster, [0, 1], rate)
                try:
                    prompt = [1000 + (7 * j) % 30000 for j in range(n)]
                    body = {"model": model, "prompt": prompt, "max_tokens": 1,
                            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
                    t0 = time.perf_counter()
                    r = httpx.post(url + "/v1/completions", json=body, timeout=300,
                                   headers={KV_TRANSFER_KEY_HEADER: KEY})  # fmt: skip
                    r.raise_for_status()
                    prefill_s = time.perf_counter() - t0
                    handle = r.json()["kv_transfer_params"]["handle"]
                    pulled = cluster.hosts[1].check_output(
                        [sys.executable, "-c", PULL, url, handle, KV_TRANSFER_KEY_HEADER, KEY]
                    )
                    seconds, nbytes = pulled.split()
                    row.append((prefill_s, float(seconds), int(nbytes)))
                finally:
                    limited(cluster, [0, 1], None)
            (p0, s0, b0), (_, s1, _) = row
            print(
                f"| {n} | {b0 / 2**20:.1f} | {1000 * p0:.0f} ms | {1000 * s0:.0f} ms | {1000 * s1:.0f} ms |"
            )
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--lengths", default="128,512,1024", help="P/D prompt lengths")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--skip-parallel", action="store_true")
    ap.add_argument("--skip-pd", action="store_true")
    args = ap.parse_args()
    reason = available()
    if reason is not None:
        print(f"no test hosts here: {reason}")
        return
    with Cluster(ClusterConfig(hosts=2)) as cluster:
        print(f"hosts: {', '.join(f'{h.name} {h.address}' for h in cluster.hosts)}; driver here at "
              f"{cluster.gateway_address}; {os.cpu_count()} cores shared by every host")  # fmt: skip
        if not args.skip_parallel:
            parallel_rows(cluster, args.quantization, args.tokens)
        if not args.skip_pd:
            pd_rows(cluster, args.quantization, [int(n) for n in args.lengths.split(",")])


if __name__ == "__main__":
    main()
