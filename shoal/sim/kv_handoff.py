"""What a prompt's K/V handoff from a prefill worker to a decode worker costs, by its size: the time
it takes to arrive (a real prefill server's K/V pulled as a decode worker pulls it), and the CPU it
takes of each worker (its engine packing or loading it, its front writing or reading it)."""

from __future__ import annotations

import random
import secrets
import time

import numpy as np

from shoal.bench.synthetic_ids import random_ids
from shoal.sim.servers import ProcessCPU, fleet_placement, running

HANDOFF_REPEATS = 3  # handoffs timed of each length


def fit_line(samples: list[tuple[float, float]], least_per_mib: float = 0.0) -> tuple[float, float]:
    """(fixed seconds, seconds per MiB) through (MiB, seconds) samples, neither below zero, and
    the slope at least `least_per_mib` (then the line keeps the samples' mean level)."""
    mib, seconds = (np.array(v, dtype=float) for v in zip(*samples, strict=True))
    per_mib, fixed = np.polyfit(mib, seconds, 1)
    if per_mib < least_per_mib:
        per_mib = least_per_mib
        fixed = float(np.mean(seconds - per_mib * mib))
    return max(0.0, float(fixed)), max(0.0, float(per_mib))


def time_kv_transfer(
    serve_flags: list[str],
    lengths: tuple[int, ...],
    max_len: int,
    seed: int,
    cpu_threads: int | None = None,
    least_cpu_per_mib: float = 0.0,
) -> dict[str, float]:
    """What handing a prompt's K/V to a decode worker costs, by its size: a real `shoal serve
    --role prefill` of the same engine prefills prompts of several lengths, and each one's K/V is
    pulled as a decode worker pulls it, over shared memory (one host) and over TCP (across
    hosts). Returns bytes per token, and per transport a line through (MiB, seconds): the fixed
    seconds of one handoff and the seconds per MiB. With `cpu_threads` (a CPU engine's threads),
    also the prefill worker's CPU for each handoff beyond its steps, as `prefill_cpu_s(_per_mib)`:
    its process's CPU over the prefill request, the pull and the release, less its engine's steps
    (their forward passes on every thread, and the host work around them), which the profile's
    step costs price. That is more than the packing and writing alone (time_handoff_cpu): the
    requests' HTTP and the prompt's tokens are handled on the worker's cores too. Its slope is kept
    at least `least_cpu_per_mib`, the engine's own packing and writing (time_handoff_cpu), a part
    of it: the steps are subtracted as wall time on every thread, and on a contended host those
    threads wait, so the subtraction overshoots most beside the longest prompts and can tilt the
    line flat (seen in CI: a 1,024-token handoff priced as a 64-token one)."""
    import httpx

    from shoal.engine.kv_connector.transports import transport_named
    from shoal.protocol.secrets import KV_TRANSFER_KEY_ENV, KV_TRANSFER_KEY_HEADER

    key, rng = secrets.token_hex(16), random.Random(seed)
    samples: dict[str, list[tuple[float, float]]] = {"shm": [], "tcp": []}
    spent: list[tuple[float, float]] = []  # (MiB, the prefill worker's CPU beyond its steps)
    per_token = []
    prefill = ["serve", *serve_flags, "--role", "prefill"]
    # Placed as a fleet places a prefill worker of these flags (pinned, its threads sized): what
    # it spends beyond its steps then comes off the cores its engine computes on.
    threads_env, cpus, _ = fleet_placement(serve_flags)
    with (
        running(prefill, {**(threads_env or {}), KV_TRANSFER_KEY_ENV: key}, cpus=cpus) as (url, proc),
        httpx.Client(timeout=300, headers={KV_TRANSFER_KEY_HEADER: key}) as client,
    ):
        beyond = ServerCPU(proc.pid, url, client, cpu_threads) if cpu_threads else None
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        for n in (n for n in lengths if n < max_len):
            for _ in range(HANDOFF_REPEATS):
                prompt = random_ids(rng, n)  # nothing cached
                hold = {"do_remote_decode": True}
                body = {"model": model, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": hold}
                window = beyond.start() if beyond else None
                served = 0.0  # the prefill worker's CPU beyond its steps, for this handoff
                answer = client.post(url + "/v1/completions", json=body).json()
                handle = answer["kv_transfer_params"]["handle"]
                for name, got in samples.items():  # shm first: what a decode worker on this host pulls
                    way = transport_named(name)
                    t0 = time.perf_counter()
                    reply = client.post(url + "/kv/pull", json={"handle": handle, "transport": name})
                    packed = way.take(reply.json() if way.reply_is_json else bytearray(reply.content))
                    got.append((packed.nbytes / 2**20, time.perf_counter() - t0))
                    per_token.append(packed.nbytes / n)
                    if window is not None and name == "shm":
                        served = beyond.stop(window)
                window = beyond.start() if beyond else None
                client.post(url + "/kv/release", json={"handle": handle})
                if beyond:
                    spent.append((packed.nbytes / 2**20, served + beyond.stop(window)))
    out = {"bytes_per_token": float(np.median(per_token))}
    for name, got in samples.items():
        out[f"{name}_s"], out[f"{name}_s_per_mib"] = fit_line(got)
    if spent:
        out["prefill_cpu_s"], out["prefill_cpu_s_per_mib"] = fit_line(spent, least_cpu_per_mib)
    return out


class ServerCPU:
    """A server's process CPU over a stretch, less its engine's steps (their forward passes on
    `threads` threads, and their host work), read from its /metrics."""

    def __init__(self, pid: int, url: str, client, threads: int):
        self.cpu = ProcessCPU(pid, "the prefill server")
        self.url, self.client, self.threads = url, client, threads

    def _steps(self) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = self.client.get(self.url + "/metrics").text
        seconds = {"forward": 0.0, "host": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for kind in seconds:
                    if sample.name == f"shoal:engine_step_{kind}_seconds_total":
                        seconds[kind] += sample.value
        return seconds["forward"] * self.threads + seconds["host"]

    def start(self) -> tuple[float, float]:
        steps = self._steps()  # the metrics' own request, before the stretch
        return self.cpu.seconds(), steps

    def stop(self, started: tuple[float, float]) -> float:
        cpu = self.cpu.seconds()
        return max(0.0, cpu - started[0] - (self._steps() - started[1]))


def time_handoff_cpu(engine, lengths: tuple[int, ...], seed: int) -> dict[str, float]:
    """The CPU a handoff takes of each worker, timed on an engine in this process: the prefill
    worker's engine packs the prompt's K/V between two steps (its next step waits for it) and its
    front writes it to shared memory; the decode worker's front reads it and its engine loads it
    into the request's blocks in the step that admits it. Each pair is a line through (MiB,
    seconds), as `prefill_cpu_s(_per_mib)` and `decode_cpu_s(_per_mib)` (none: an engine whose K/V
    does not move, a parallel one). Where a prefill server is timed too (time_kv_transfer), its
    reading of the prefill side, which holds the requests' HTTP as well, replaces this one's, at
    this one's slope or steeper."""
    from shoal.engine.kv_connector.transports import transport_named
    from shoal.engine.sampling_params import SamplingParams

    core = engine.core
    runner = getattr(core.executor, "runner", None)
    if not core.executor.moves_kv or runner is None:
        return {}
    shm, rng = transport_named("shm"), random.Random(seed)
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    sides: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": []}
    per_token = []
    for n in (n for n in lengths if n < engine.max_model_len):
        for i in range(HANDOFF_REPEATS):
            rid = f"handoff-{n}-{i}"
            prompt = random_ids(rng, n)  # nothing cached
            engine.add_request(rid, prompt, params, hold_kv=True)
            while engine.has_unfinished_requests():
                engine.step()
            t0 = time.perf_counter()
            packed = core.pack_new_handoffs()[rid]
            reply, _ = shm.send(packed)
            t1 = time.perf_counter()
            taken = shm.take(reply)
            # Its own K/V back into its own blocks: the copy a decode worker makes, changing nothing.
            runner.import_kv(core.kv.block_ids(rid), taken.data)
            t2 = time.perf_counter()
            core.release_kv(rid)
            mib = packed.nbytes / 2**20
            sides["prefill"].append((mib, t1 - t0))
            sides["decode"].append((mib, t2 - t1))
            per_token.append(packed.nbytes / n)
    if not per_token:
        return {}
    out = {"bytes_per_token": float(np.median(per_token))}
    for side, got in sides.items():
        out[f"{side}_cpu_s"], out[f"{side}_cpu_s_per_mib"] = fit_line(got)
    return out
