"""Timed engine steps: a recorder that feeds an engine prompts and times each step by its shape,
the samples' file, and the runs of decode steps a fit reads as one sample each."""

from __future__ import annotations

import random
import time

from shoal.bench.synthetic_ids import random_ids
from shoal.engine.step_shape import StepShape, step_shape
from shoal.engine.step_trace import step_line


class StepRecorder:
    """Feeds prompts of random tokens to an engine and times each of its steps by shape."""

    def __init__(self, engine, seed: int):
        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = engine.tokenizer.vocab_size
        self.samples: list[tuple[StepShape, float]] = []
        self._ids = 0

    def prompt(self, n: int) -> list[int]:
        return random_ids(self.rng, n, self.vocab)

    def add(self, prompt_len: int, max_tokens: int) -> None:
        from shoal.engine.sampling_params import SamplingParams

        self._ids += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.engine.add_request(f"profile-{self._ids}", self.prompt(prompt_len), params)

    def run(self, inject: dict[int, list[int]] | None = None, record: bool = True) -> None:
        """Steps until idle; `inject` adds prompts of the given lengths before step i."""
        core, i = self.engine.core, 0
        while self.engine.has_unfinished_requests():
            for n in (inject or {}).get(i, ()):
                self.add(n, 4)
            before = core.num_steps
            t0 = time.perf_counter()
            self.engine.step()
            dt = time.perf_counter() - t0
            if record and core.num_steps > before and core.last_step is not None:
                self.samples.append((step_shape(core.last_step), dt))
            i += 1


def merge_decode_runs(steps: list[tuple[StepShape, float]]) -> list[tuple[StepShape, float]]:
    """Consecutive decode-only steps of the same rows as one sample: their mean shape and time.
    On a GPU that decodes ahead (engine.decode_ahead) a step's wall time depends on what the step
    before it queued, so single steps of one batch spread widely around their mean, and a fit of
    relative error leans to the fast ones (an H200's decode fit: 30 % at the median); a run's mean
    is what the run costs."""
    out: list[tuple[StepShape, float]] = []
    run: list[tuple[StepShape, float]] = []

    def flush() -> None:
        if run:
            n = len(run)
            mean = StepShape(
                run[0][0].rows,
                run[0][0].tokens,
                round(sum(s.context for s, _ in run) / n),
                round(sum(s.attention for s, _ in run) / n),
            )
            out.append((mean, sum(t for _, t in run) / n))
            run.clear()

    for shape, dt in steps:
        if run and not (shape.decode_only and shape.rows == run[0][0].rows):
            flush()
        (run if shape.decode_only else out).append((shape, dt))
    flush()
    return out


def write_samples(samples: list[tuple[StepShape, float]], path: str) -> None:
    with open(path, "w") as f:
        f.writelines(step_line(shape, seconds) for shape, seconds in samples)
