"""What the simulator serves: requests with an arrival time, prompt tokens and an output length,
drawn from a description (arrivals with bursts, length distributions, shared prefixes, tenants)
or read from a trace the gateway recorded."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from shoal.bench.arrivals import Burst, arrival_times
from shoal.bench.synthetic_ids import random_ids


@dataclass
class SimRequest:
    id: str
    arrival: float  # seconds since the run began (under a concurrency cap: when it may be sent)
    prompt: list[int] | None  # its tokens (None: only its length is known, for the fast simulator)
    output_len: int
    tenant: str = "anonymous"
    priority: int = 0
    model: str | None = None
    # The shared prefix its prompt starts with, if any (what the fast simulator's caches track).
    prefix_id: int | None = None
    prefix_len: int = 0
    length: int = 0  # the prompt's length when `prompt` is None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt) if self.prompt is not None else self.length


@dataclass
class Lengths:
    """A length distribution: "fixed" (mean), "uniform" (mean ± spread) or "lognormal" (mean, with
    spread the standard deviation of the log)."""

    kind: str = "fixed"
    mean: int = 128
    spread: float = 0.0
    low: int = 1

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            n = self.mean
        elif self.kind == "uniform":
            n = rng.randint(int(self.mean - self.spread), int(self.mean + self.spread))
        elif self.kind == "lognormal":
            mu = math.log(self.mean) - self.spread**2 / 2  # so that the mean is `mean`
            n = round(rng.lognormvariate(mu, self.spread))
        else:
            raise ValueError(f"unknown length distribution {self.kind!r}")
        return max(self.low, n)

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """ "128", "uniform:128:64" or "lognormal:128:0.5"."""
        parts = str(text).split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", int(parts[0]))
            return cls(parts[0], int(parts[1]), float(parts[2]) if len(parts) > 2 else 0.0)
        except (ValueError, IndexError) as exc:
            raise ValueError(
                f"bad length {text!r}: give N, uniform:MEAN:SPREAD or lognormal:MEAN:SIGMA"
            ) from exc


@dataclass
class WorkloadSpec:
    num_requests: int = 1000
    rate: float = math.inf  # mean Poisson arrivals per second; inf: all at once
    bursts: list[Burst] = field(default_factory=list)
    input_len: Lengths = field(default_factory=lambda: Lengths("fixed", 256))
    output_len: Lengths = field(default_factory=lambda: Lengths("fixed", 128))
    # Prompts that start with one of `num_prefixes` shared prefixes of `prefix_len` tokens (counted
    # inside input_len), as system prompts and few-shot headers do.
    num_prefixes: int = 0
    prefix_len: int = 0
    tenants: dict[str, float] = field(default_factory=dict)  # name -> share of the requests
    seed: int = 0

    def arrivals(self, rng: random.Random) -> list[float]:
        return arrival_times(self.num_requests, self.rate, self.bursts, rng)

    def requests(self, with_tokens: bool = True) -> list[SimRequest]:
        """`with_tokens`: draw each prompt's tokens (the exact simulator hashes them); without,
        only lengths and prefix ids (the fast one needs no more, and a million prompts of tokens
        take minutes to draw)."""
        with paused_gc():
            return self._requests(with_tokens)

    def _requests(self, with_tokens: bool) -> list[SimRequest]:
        rng = random.Random(self.seed)
        draw = random.Random(self.seed + 1)  # tokens apart: with or without them, the same requests
        prefixes = [tokens(draw, self.prefix_len) if with_tokens else [] for _ in range(self.num_prefixes)]
        names = list(self.tenants) or ["anonymous"]
        weights = list(self.tenants.values()) or [1.0]
        out = []
        for i, at in enumerate(self.arrivals(rng)):
            n = self.input_len.draw(rng)
            which = rng.randrange(len(prefixes)) if prefixes else None
            head = min(self.prefix_len, n - 1) if prefixes else 0
            shared = prefixes[which][:head] if prefixes else []
            prompt = shared + tokens(draw, n - head) if with_tokens else None
            tenant = rng.choices(names, weights)[0] if self.tenants else "anonymous"
            req = SimRequest(f"sim-{i}", at, prompt, self.output_len.draw(rng), tenant)
            req.prefix_id, req.prefix_len, req.length = which, head, n
            out.append(req)
        return out


@contextlib.contextmanager
def paused_gc():
    """The cyclic garbage collector off while millions of objects that form no cycle are made:
    each of its full passes walks all of them, so a run would slow as it grows."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def tokens(rng: random.Random, n: int) -> list[int]:
    return random_ids(rng, n)


def block_tokens(block_hash: int, block_size: int) -> list[int]:
    """Stand-in tokens for a block known only by its hash: the same hash always gives the same
    tokens, so prompts that shared blocks in the trace share them in the simulator too."""
    return tokens(random.Random(block_hash), block_size)


def load_trace(path: str | Path, block_size: int = 16) -> list[SimRequest]:
    """Requests from a gateway trace (JSON lines: t, input_len, output_len, tenant, model,
    priority, block_hashes), in arrival order, the first at 0."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the trace: {exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            n = int(rec["input_len"])
            prompt = [t for h in rec.get("block_hashes", []) for t in block_tokens(int(h), block_size)][
                : n - 1
            ]
            rng = random.Random(f"{number}")
            prompt += tokens(rng, n - len(prompt))
            out.append(
                SimRequest(
                    rec.get("id", f"trace-{number}"),
                    float(rec["t"]),
                    prompt,
                    max(1, int(rec["output_len"])),
                    rec.get("tenant", "anonymous"),
                    int(rec.get("priority", 0)),
                    rec.get("model"),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a trace record ({exc})") from exc
    out.sort(key=lambda r: r.arrival)
    first = out[0].arrival if out else 0.0
    for r in out:
        r.arrival -= first
    return out
