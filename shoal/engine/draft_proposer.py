"""A draft model proposes: a cheaper model that shares the target's tokenizer (on this machine,
the bundled SmolLM2 in int4 drafting for itself in fp32 or int8) runs k greedy steps ahead.

It has its own paged KV pool and block tables, kept here, and runs through its own ModelRunner
with the same step messages the engine uses. Each call first catches the draft's K/V up with the
tokens the target accepted since the last call (one chunk per request), then decodes k - 1 more
tokens, all requests batched in each pass. Its guesses are greedy, a point mass, which is what
the target's rejection sampling (Sampler.verify) assumes.
"""

from __future__ import annotations

from shoal.engine.model_runner import ModelRunner
from shoal.engine.sampler import SamplingState
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from shoal.engine.speculative import Proposer

_GREEDY = SamplingParams(temperature=0)


class DraftProposer(Proposer):
    def __init__(self, runner: ModelRunner, k: int, max_positions: int):
        self.runner = runner
        self.k = k
        self.max_positions = max_positions
        self.block_size = runner.block_size
        self.free_blocks = list(range(runner.num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        # The context whose draft K/V is written, per request. Kept as tokens, not a count: a
        # step that failed after proposing runs again, and only what still matches is reused.
        self.computed: dict[str, list[int]] = {}
        self._dropped: list[str] = []
        self._step = 0

    def drop(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.free_blocks.extend(reversed(table))
            self.computed.pop(request_id, None)
            self._dropped.append(request_id)

    def _grow(self, rid: str, positions: int) -> list[int] | None:
        """Blocks added so the request's draft table holds `positions`; None if the pool is short."""
        table = self.tables.setdefault(rid, [])
        need = -(-positions // self.block_size) - len(table)
        if need > len(self.free_blocks):
            return None
        added = [self.free_blocks.pop() for _ in range(max(0, need))]
        table.extend(added)
        return added

    def propose(self, requests: dict[str, SamplingState]) -> dict[str, list[int]]:
        first = SchedulerOutput(finished_ids=self._dropped)
        self._dropped = []
        contexts: dict[str, list[int]] = {}
        for rid, state in requests.items():
            context = state.prompt_token_ids + state.output_token_ids
            k = min(self.k, self.max_positions - len(context))
            if state.matcher is not None or k < 1:
                continue
            fresh = rid not in self.tables
            added = self._grow(rid, len(context) + k - 1)
            if added is None:
                self.drop(rid)
                continue
            done = 0 if fresh else _common_prefix(self.computed[rid], context, len(context) - 1)
            if fresh:
                first.new_requests.append(NewRequestData(rid, [], _GREEDY, 0, [], list(self.tables[rid])))
            first.scheduled.append(
                ScheduledRequest(rid, context[done:], done, new_block_ids=[] if fresh else added)
            )
            self.computed[rid] = context
            contexts[rid] = context
        if not first.scheduled:
            if first.finished_ids:  # let the draft runner forget them now
                self._run(first)
            return {}
        guesses = self._run(first)
        for j in range(1, self.k):
            more = SchedulerOutput()
            for rid, context in contexts.items():
                if len(context) + j < self.max_positions:
                    more.scheduled.append(ScheduledRequest(rid, [guesses[rid][-1]], len(context) + j - 1))
            if not more.scheduled:
                break
            for rid, toks in self._run(more).items():
                guesses[rid] += toks
        return guesses

    def _run(self, so: SchedulerOutput) -> dict[str, list[int]]:
        self._step += 1
        so.step_id = self._step
        so.num_batched_tokens = sum(sr.num_tokens for sr in so.scheduled)
        return self.runner.execute(so).sampled


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most `limit`."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    limit, n = n, 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        n += 1
    return n
