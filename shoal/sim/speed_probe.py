"""How fast this host runs the profiled engine now, against when it was profiled. A shared host's
speed drifts by 10-20 % over minutes (noisy neighbours), and a fleet near its capacity turns that
into tens of per cent of queueing; a profile is rescaled to the host as it is before a run that it
predicts. The probe is a fixed run of steps (prompts alone, then a small batch decoding) on a
fresh engine in its own process, timed whole, the same way both times."""

from __future__ import annotations

import time

from shoal.sim.servers import in_fresh_engine

PROBE_PROMPT = 512  # tokens of each lone prompt (less where the context is shorter)
PROBE_ROWS, PROBE_STEPS = 4, 16  # then this many 128-token requests decode this many tokens
PROBE_ROUNDS = 2


def run_probe(engine, seed: int = 0) -> float:
    """Seconds this engine takes for the probe's steps (after one warm-up request)."""
    from shoal.sim.step_samples import StepRecorder

    rec = StepRecorder(engine, seed)
    rec.add(64, 4)
    rec.run(record=False)
    prompt = min(PROBE_PROMPT, engine.max_model_len - PROBE_STEPS - 1)
    t0 = time.perf_counter()
    for _ in range(PROBE_ROUNDS):
        rec.add(prompt, 1)
        rec.run(record=False)
        for _ in range(PROBE_ROWS):
            rec.add(128, PROBE_STEPS)
        rec.run(record=False)
    return time.perf_counter() - t0


def probe_seconds(engine_options: dict, seed: int = 0) -> float:
    """run_probe on a fresh engine of these options (LLM(**options)), in a process of its own."""
    then = "from shoal.sim.speed_probe import run_probe; print(run_probe(llm.engine, int(sys.argv[2])))"
    return float(in_fresh_engine(f"{then}; llm.shutdown()", engine_options, str(seed)).split()[-1])
