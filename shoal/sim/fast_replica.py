"""One replica of the fast simulator (fast.py), with the scheduler's rules held in aggregate:
each step gives the token budget to decodes first, then to prompts already running, then admits
waiting ones first come first served while a row and KV blocks are free; a pool that runs dry
preempts the newest request (recompute); a prompt whose shared prefix a replica still holds skips
it, and the blocks of a prefix are held once for all the requests that use it. What makes it fast:
decode rows are not walked. A decoding request only notes the step count at which it will finish,
so a stretch of steps with nothing to admit is one event, cut short when a request arrives."""

from __future__ import annotations

import heapq
import math
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from shoal.engine.config import SchedulerConfig
from shoal.sim.profile import NodeProfile
from shoal.sim.workload import SimRequest

ITL_BUCKETS = np.geomspace(1e-5, 1e3, 801)  # inter-token times end in a histogram of these bounds


@dataclass(slots=True)
class Flow:
    """One request inside a replica."""

    index: int  # into the run's result arrays
    prompt_len: int  # its prompt (after a preemption: prompt and output so far)
    prompt_left: int  # of those, not yet computed
    out_left: int  # output tokens still to come
    out_done: int
    prefix_id: int | None
    prefix_len: int
    seq: int  # arrival order: the newest is preempted first
    joined: int = 0  # the clock when it began to decode
    shared: int = 0  # tokens of its prefix held once for every request that uses them
    sent: float = 0.0
    external: int = 0  # prompt tokens whose K/V came from a prefill worker, held at its admission
    handoff_to: int = -1  # a prefill worker's part: the decode worker its K/V goes to (ABANDONED)


# A prefill worker's part the gateway gave up on (its timeout): computed, then dropped.
ABANDONED = -2


class FastReplica:
    def __init__(
        self,
        index: int,
        profile: NodeProfile,
        max_num_seqs: int,
        max_tokens: int,
        holders: dict[int, dict[int, None]],
        out: RunArrays,
        overhead: float = 0.0,
        loads: list[int] | None = None,
    ):
        """`holders`: the fleet's map of which replicas hold which shared prefix, latest last;
        `out`: where each request's figures go; `loads`: the fleet's list of each replica's
        requests in its hands (routing reads it for every request: one flat list, not N objects)."""
        self.index = index
        self.profile = profile
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_tokens
        self.block_size = profile.block_size
        self.num_kv_blocks = profile.num_kv_blocks
        self.reserve = int(SchedulerConfig.admission_watermark * profile.num_kv_blocks)
        self._per_context = profile.decode.per_context_token
        self.overhead = overhead  # seconds each request spends outside the engine
        self.holders = holders
        self.out = out
        self._planned: tuple[list[tuple[Flow, int]], int, float] | None = None  # chunks, rows, seconds
        self.waiting: deque[Flow] = deque()
        self.prefilling: list[Flow] = []
        self.decoding: list[tuple[int, int, Flow]] = []  # heap: (the clock at its finish, arrival order, it)
        self.clock = 0  # decode steps taken: a decoding row gains one token each
        self.tokens = 0  # K/V tokens held by running requests
        self.decode_context = 0  # sum of the decoding rows' context lengths
        self.prefixes: OrderedDict[int, int] = OrderedDict()  # resident shared prefixes -> blocks
        self.pinned: dict[int, int] = {}  # prefix id -> running requests using it
        self.idle_cached = 0  # blocks of cached prefixes no running request uses
        self.loads = loads if loads is not None else [0] * (index + 1)
        self.busy_until: float | None = None
        self.version = 0  # bumps when its pending event is replaced
        # A stretch of identical decode steps: (start, steps, rows, first step's cost less the
        # growth, growth of each step's cost over the last).
        self.segment: tuple[float, int, int, float, float] | None = None
        self.steps = 0
        self.waking = False  # offline, given work while idle: its next event plans a step, ends none
        self.handed: list[Flow] = []  # prefill parts whose prompt is done: their K/V leaves now
        self._seq = 0

    @property
    def outstanding(self) -> int:
        """Requests in its hands: waiting, prefilling or decoding."""
        return self.loads[self.index]

    # --- KV ---------------------------------------------------------------------------------

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks() / self.num_kv_blocks

    def free_blocks(self) -> int:
        running = len(self.decoding) + len(self.prefilling)  # each row's last block is half full
        return self.num_kv_blocks - (-(-self.tokens // self.block_size) + running // 2)

    def _trim_prefixes(self) -> None:
        """Cached prefixes nobody uses sit in free blocks: the oldest go when those run short."""
        room = self.free_blocks()
        need = self.idle_cached - room
        if need <= 0:
            return
        victims = []
        pinned = self.pinned
        for pid, blocks in self.prefixes.items():  # oldest first; collected, then evicted
            if need <= 0:
                break
            if not pinned.get(pid):
                victims.append(pid)
                need -= blocks
        for pid in victims:
            self.idle_cached -= self.prefixes.pop(pid)
            self.holders[pid].pop(self.index, None)

    def drop_cache(self) -> None:
        """It went down (idle): if it comes back, it holds no cached prefix."""
        for pid in self.prefixes:
            self.holders[pid].pop(self.index, None)
        self.prefixes.clear()
        self.idle_cached = 0

    def _prefix_tokens(self, f: Flow) -> int:
        # Whole blocks only, and never the whole prompt: its last token is always computed.
        return min(f.prefix_len, f.prompt_len - 1) // self.block_size * self.block_size

    def _share(self, f: Flow, tokens_held: bool) -> None:
        """f uses the cached blocks of its prefix, held once for all their users while any runs
        (`tokens_held`: f computed them itself, and counted them as its own until now)."""
        pid, own = f.prefix_id, self._prefix_tokens(f)
        new = pid not in self.prefixes
        if new:
            self.prefixes[pid] = own // self.block_size
            self.holders.setdefault(pid, {})[self.index] = None
        self.prefixes.move_to_end(pid)
        size = self.prefixes[pid] * self.block_size
        f.shared = min(size, own)
        if tokens_held:
            self.tokens -= f.shared
        users = self.pinned.get(pid, 0)
        if not users:
            self.tokens += size
            if not new:
                self.idle_cached -= self.prefixes[pid]  # it sat in the cache, unused
        self.pinned[pid] = users + 1

    def _unshare(self, f: Flow) -> None:
        if not f.shared:
            return
        pid = f.prefix_id
        users = self.pinned[pid] - 1
        if users:
            self.pinned[pid] = users
        else:
            del self.pinned[pid]
            self.tokens -= self.prefixes[pid] * self.block_size  # cached: free until evicted
            self.idle_cached += self.prefixes[pid]
        f.shared = 0
        self._trim_prefixes()

    def cached_prefix_blocks(self, prefix_id: int | None) -> int:
        """Blocks of a shared prefix it holds now."""
        return self.prefixes.get(prefix_id, 0) if prefix_id is not None else 0

    def _prefix_hit(self, f: Flow) -> int:
        if f.prefix_id is None or f.prefix_id not in self.prefixes:
            return 0
        return min(self.prefixes[f.prefix_id] * self.block_size, self._prefix_tokens(f))

    # --- requests ---------------------------------------------------------------------------

    def add(self, index: int, req: SimRequest, sent: float, external: int = 0, handoff_to: int = -1) -> None:
        """`sent`: when the client sent it; `external`: prompt tokens whose K/V a prefill worker
        computed; `handoff_to`: this is a prefill worker's part of the request, one token, whose
        K/V goes on to that decode worker."""
        n = req.prompt_len
        out = 1 if handoff_to >= 0 else max(1, min(req.output_len, self.profile.max_model_len - n))
        self._seq += 1
        f = Flow(index, n, n - external, out, 0, req.prefix_id, req.prefix_len, self._seq, sent=sent)
        f.external, f.handoff_to = external, handoff_to
        self.waiting.append(f)
        self.loads[self.index] += 1

    def abandon(self, index: int) -> None:
        """The gateway gave up on request `index`'s prefill part here: it leaves the queue now, or,
        being computed, is dropped when its prompt is done (a real engine sees an abort between
        its steps, and a prompt here is a step or few)."""
        for f in self.waiting:
            if f.index == index:
                self.waiting.remove(f)
                self.loads[self.index] -= 1
                return
        for f in self.prefilling:
            if f.index == index:
                f.handoff_to = ABANDONED

    def can_admit(self) -> bool:
        waiting = self.waiting
        if not waiting:
            return False
        running = len(self.decoding) + len(self.prefilling)
        if running >= self.max_num_seqs:
            return False
        f = waiting[0]
        need = -(-(min(f.prompt_left, self.max_tokens) + f.external) // self.block_size)
        return need <= self.free_blocks() - self.reserve

    def _preempt(self) -> bool:
        """The newest running request gives its blocks back and waits again (recompute)."""
        rows = [f for f in self.prefilling] + [f for _, _, f in self.decoding]
        if not rows:
            return False
        victim = max(rows, key=lambda f: f.seq)
        if victim in self.prefilling:
            self.prefilling.remove(victim)
            self.tokens -= victim.prompt_len - victim.prompt_left - victim.shared
        else:
            self.decoding = [e for e in self.decoding if e[2] is not victim]
            heapq.heapify(self.decoding)
            steps = self.clock - victim.joined
            ctx = victim.prompt_len + steps
            self.tokens -= ctx - victim.shared
            self.decode_context -= ctx
            victim.out_left -= steps
            victim.out_done += steps
            victim.prompt_len = ctx + 1  # the last sampled token too: recomputed as prompt
        self._unshare(victim)
        victim.prompt_left = victim.prompt_len  # handed K/V is given back too: all recomputed
        self.waiting.appendleft(victim)
        return True

    # --- steps ------------------------------------------------------------------------------

    def plan(self, now: float) -> float | None:
        """Plans the next step, or a stretch of decode steps with nothing to admit; returns when it
        ends (None: nothing to run)."""
        rows = len(self.decoding)
        if rows and not self.prefilling and not self.can_admit():
            # Steps until the first finish, and never so many that the decodes run the pool dry.
            k = self.decoding[0][0] - self.clock
            k = max(1, min(k, self.free_blocks() * self.block_size // rows))
            # Each step of the stretch costs `g` more than the last: its rows' context grows.
            g = self._per_context * rows
            a = self.profile.decode.decode_seconds(rows, self.decode_context + rows) - g
            self.segment = (now, k, rows, a, g)
            return now + segment_time(a, g, k)
        if not rows and not self.prefilling and not self.waiting:
            return None
        self.tokens += rows  # each decode computes one more token's K/V
        preempted = False
        while self.free_blocks() < 0 and self.prefilling + self.decoding:
            self.tokens -= len(self.decoding)
            self._preempt()
            self.tokens += len(self.decoding)
            preempted = True
        rows = len(self.decoding)
        budget = self.max_tokens - rows
        chunks = []
        for f in self.prefilling:
            if budget <= 0:
                break
            n = min(f.prompt_left, budget)
            chunks.append((f, n))
            budget -= n
            self.tokens += n
        loading = 0.0  # handed K/V the step admits: read in by its front, loaded by its engine
        while budget > 0 and not preempted and self.can_admit():
            f = self.waiting.popleft()
            hit = self._prefix_hit(f) if f.prompt_left == f.prompt_len else 0
            if hit:
                f.prompt_left -= hit
                self._share(f, tokens_held=False)
            n = min(f.prompt_left, budget)
            self.prefilling.append(f)
            chunks.append((f, n))
            budget -= n
            self.tokens += n + f.external
            if f.external:
                loading += self.profile.kv_handoff_cpu_seconds(f.external, "decode")
            f.external = 0
        if not rows and not chunks:
            return None
        # The step's shape (see StepShape) without walking its decode rows: their context is kept
        # as a sum, and a decode row is one token at its end.
        context = self.decode_context + rows
        n_rows, n_tokens, n_context, attention = rows, rows, context, context
        for f, n in chunks:
            end = f.prompt_len - f.prompt_left + n
            n_rows += 1
            n_tokens += n
            n_context += end
            attention += n * end
        # A step of one token a row (a handed prompt's last token among them) is priced as a decode.
        cost = self.profile.mixed if n_tokens > n_rows else self.profile.decode
        seconds = cost.cost(n_rows, n_tokens, n_context, attention) + loading
        self._planned = (chunks, rows, seconds)
        self.steps += 1
        return now + seconds

    def cut(self, now: float) -> float | None:
        """A request arrived during a stretch of decode steps: the stretch ends with the step in
        progress (when it ends is returned), so the next step can admit it."""
        if self.segment is None:
            return None
        start, k, rows, a, g = self.segment
        m = steps_by(a, g, now - start)
        if m >= k:
            return None
        self.segment = (start, m, rows, a, g)
        return start + segment_time(a, g, m)

    def finish(self, now: float) -> None:
        """The planned step (or stretch) ends at `now`."""
        out = self.out
        decoding = self.decoding
        if self.segment is not None:
            _, k, rows, a, g = self.segment
            self.segment = None
            self.steps += k
            clock = self.clock = self.clock + k
            self.tokens += rows * k
            self.decode_context += rows * k
            # The stretch's first and last steps stand for it.
            out.itl_seconds.extend((a + g, a + g * k))
            half = rows * k / 2
            out.itl_weights.extend((half, half))
        else:
            chunks, rows, seconds = self._planned
            self._planned = None
            if rows:
                self.clock += 1
                self.decode_context += rows
                out.itl_seconds.append(seconds)
                out.itl_weights.append(rows)
            clock = self.clock
            ttft = out.ttft
            for f, n in chunks:
                left = f.prompt_left = f.prompt_left - n
                if left:
                    continue
                self.prefilling.remove(f)
                if f.prefix_id is not None and not f.shared:
                    self._share(f, tokens_held=True)  # computed here: cached for the next ones
                if f.handoff_to != -1:
                    self._release(f, f.prompt_len)
                    if f.handoff_to >= 0:
                        self.handed.append(f)
                    continue
                if ttft[f.index] != ttft[f.index]:  # NaN: its first token
                    ttft[f.index] = now - f.sent + self.overhead
                    if out.first_tokens is not None:
                        out.first_tokens.append((now + self.overhead, ttft[f.index]))
                f.out_done += 1
                out_left = f.out_left = f.out_left - 1
                if out_left == 0:
                    self._done(f, now, f.prompt_len)
                    continue
                f.joined = clock
                self.decode_context += f.prompt_len
                heapq.heappush(decoding, (clock + out_left, f.seq, f))
        while decoding and decoding[0][0] <= clock:
            f = heapq.heappop(decoding)[2]
            steps = clock - f.joined
            ctx = f.prompt_len + steps
            self.decode_context -= ctx
            f.out_done += steps
            self._done(f, now, ctx)

    def _release(self, f: Flow, ctx: int) -> None:
        self.tokens -= ctx - f.shared
        self._unshare(f)
        self.loads[self.index] -= 1

    def _done(self, f: Flow, now: float, ctx: int) -> None:
        self._release(f, ctx)
        self.out.e2e[f.index] = now - f.sent + self.overhead
        self.out.output_tokens[f.index] = f.out_done


def segment_time(a: float, g: float, k: int) -> float:
    """k decode steps whose first costs a + g and each the next g more."""
    return k * a + g * k * (k + 1) / 2


def steps_by(a: float, g: float, t: float) -> int:
    """The step in progress at time t of a stretch: its number (1-based)."""
    if g <= 0:
        return max(1, math.ceil(t / a)) if a > 0 else 1
    m = math.ceil((-(a + g / 2) + math.sqrt((a + g / 2) ** 2 + 2 * g * t)) / g)
    while m > 1 and segment_time(a, g, m - 1) >= t:
        m -= 1
    while segment_time(a, g, m) < t:
        m += 1
    return max(1, m)


class RunArrays:
    """Per-request figures of a run in flat lists (a million requests do not fit in objects),
    and inter-token times as a histogram."""

    def __init__(self, n: int):
        nan = float("nan")
        self.start = [0.0] * n
        self.ttft = [nan] * n
        self.e2e = [nan] * n
        self.output_tokens = [0] * n
        self.input_len = [0] * n
        # Inter-token times as they come (seconds, and how many tokens waited that long), binned
        # into a histogram when the run ends.
        self.itl_seconds = array("d")
        self.itl_weights = array("d")
        # (when, TTFT) of each first token, kept only for an autoscaler that reads recent TTFTs.
        self.first_tokens: deque[tuple[float, float]] | None = None

    def itl_counts(self) -> np.ndarray:
        seconds = np.frombuffer(self.itl_seconds, dtype=np.float64)
        weights = np.frombuffer(self.itl_weights, dtype=np.float64)
        return np.bincount(np.searchsorted(ITL_BUCKETS, seconds), weights, len(ITL_BUCKETS) + 1)

    def arrays(self) -> RunArrays:
        """The same figures as numpy arrays."""
        out = RunArrays(0)
        for name in ("start", "ttft", "e2e", "output_tokens", "input_len"):
            setattr(out, name, np.array(getattr(self, name)))
        out.itl_seconds, out.itl_weights = self.itl_seconds, self.itl_weights
        return out
