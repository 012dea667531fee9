"""A replica's start, timed as a fleet sees it: from its process's spawn to its first ready answer,
alone on the host and beside a replica that serves (as an autoscaled pool starts one: its replicas
are busy, or it would not want another)."""

from __future__ import annotations

import random
import statistics
import threading
import time

from shoal.bench.synthetic_ids import random_ids
from shoal.sim.servers import fleet_placement, in_fresh_engine, running

STARTUP_POLL_S = 0.05  # how often a timed server start asks whether it is ready
# The load beside a busy start: clients that never pause, each streaming a prompt of this many
# tokens and that many tokens out (the pool's rows scale up at 4 in flight a replica, and hold 9 to
# 20 on the busy one while the new one starts; their prompts are 256 tokens).
BUSY_CLIENTS = 8
BUSY_PROMPT_TOKENS = 256
BUSY_OUTPUT_TOKENS = 64
# Starts timed beside it, their median kept: on this 2-core host one start's own CPU went from 2.5
# to 4.2 s within minutes (the host's speed), and the pool's TTFT p99 moves by half with 0.6 s of
# its second replica's start; three starts' mean read 3.3 to 5.9 s over a week's profiles.
BUSY_STARTS = 7


def time_startup(serve_flags: list[str] | None, engine_options: dict) -> dict[str, float]:
    """Seconds until a new replica takes requests: "first" may read the weights from disk, "again"
    finds them in the page cache, "busy" is the median of starts beside a replica serving clients
    (only where the flags pin a replica to fewer cores than the host has: the busy one takes the
    others). With `serve_flags`, a `shoal serve` process from its spawn to its first ready
    answer, which is what a fleet waits for before it routes to a replica it started (an
    autoscaled pool simulated with the engine's time once took its second replica too early; the
    server loads its model while its front starts, so the two are now close); without, an engine
    in a fresh interpreter."""
    if serve_flags is None:
        return {label: engine_start_seconds(engine_options) for label in ("first", "again")}
    out = {label: server_start_seconds(serve_flags) for label in ("first", "again")}
    busy = busy_start_seconds(serve_flags)
    if busy is not None:
        out["busy"] = busy
    return out


def engine_start_seconds(engine_options: dict) -> float:
    """From a fresh interpreter's spawn to its engine built; not its exit, which no replica waits
    for (a torch process's teardown took about a second here, and made the engine alone read
    slower than a whole server once the server's start lost its second read of the GGUF)."""
    t0 = time.time()
    built = in_fresh_engine("import time; print(time.time())", engine_options).split()[-1]
    return float(built) - t0


def server_start_seconds(serve_flags: list[str]) -> float:
    """A server's start as a fleet starts a replica of these flags: with `--threads N`, pinned to N
    of this host's cores with that many threads; polled as a gateway probes (servers.wait_for)."""
    env, pin, _ = fleet_placement(serve_flags)
    t0 = time.perf_counter()
    with running(["serve", *serve_flags], env, poll_s=STARTUP_POLL_S, cpus=pin):
        return time.perf_counter() - t0


def busy_start_seconds(serve_flags: list[str], starts: int = BUSY_STARTS) -> float | None:
    """The median of `starts` server starts on their cores (as server_start_seconds) while
    another replica of the same flags, on the host's other cores, serves clients that never pause:
    a pool's scale-up. On this 2-core host twenty such one-core starts took 2.6 to 4.2 s (median
    2.9), and alone 2.5 to 4.1; an autoscaled pool's second replica, started in a burst, ran its
    first step 3.1 to 3.6 s after the autoscaler asked for it. None: no other cores to run the busy
    replica on. RuntimeError: the busy replica streamed nothing while the starts were timed (they
    were not timed beside a busy replica)."""
    env, pin, others = fleet_placement(serve_flags)
    if not others:
        return None
    replica = running(["serve", *serve_flags], env, cpus=others[-len(pin) :])
    with replica as (url, _), BusyClients(url) as clients:
        clients.wait_streaming()
        streamed = clients.streamed
        timed = [server_start_seconds(serve_flags) for _ in range(starts)]
        # Not asked of each start: the clients' prompts, sent at once, can keep a start's few
        # seconds in one prefill that streams nothing.
        if clients.streamed == streamed:
            raise RuntimeError("the busy replica streamed nothing while the starts were timed beside it")
    return statistics.median(timed)


class BusyClients:
    """BUSY_CLIENTS threads streaming completions from `url` one after another until the exit,
    which says what went wrong if a request was refused (a load that never ran times nothing)."""

    def __init__(self, url: str):
        self.url = url
        self.model = ""
        self.errors: list[str] = []
        self.streamed = 0  # chunks the clients have read (a count, so no lock: read for change)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(BUSY_CLIENTS)
        ]

    def __enter__(self) -> BusyClients:
        import httpx

        self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for t in self._threads:
            t.start()
        return self

    def wait_streaming(self, timeout_s: float = 120.0) -> None:
        """Returns once the clients read their first tokens (their prompts' prefill is done)."""
        deadline = time.monotonic() + timeout_s
        while not self.streamed:
            if self.errors or time.monotonic() > deadline:
                raise RuntimeError(f"the busy replica streamed nothing: {self.errors[:1] or 'timed out'}")
            time.sleep(STARTUP_POLL_S)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        if self.errors and exc[0] is None:
            raise RuntimeError(f"the busy replica refused its load: {self.errors[0]}")

    def _client(self, seed: int) -> None:
        import httpx

        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self._stop.is_set():
                prompt = random_ids(rng, BUSY_PROMPT_TOKENS)  # drawn afresh: nothing cached
                body = {"model": self.model, "prompt": prompt, "max_tokens": BUSY_OUTPUT_TOKENS}
                try:
                    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                        if resp.status_code != 200:
                            self.errors.append(f"{resp.status_code} {resp.read().decode()[:300]}")
                            return
                        for _ in resp.iter_bytes():
                            self.streamed += 1
                            if self._stop.is_set():
                                break
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    return
