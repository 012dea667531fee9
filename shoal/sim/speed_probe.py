"""How fast this host runs the profiled engine now, against the profile's own step costs. A shared
host's speed drifts by 10-20 % over minutes (noisy neighbours), and a fleet near its capacity turns
that into tens of per cent of queueing; a profile is rescaled to the host as it is before a run
that it predicts. The probe is a fixed run of steps (prompts alone, then a small batch decoding) on
a fresh engine in its own process. Its reference is what the profile's fitted steps price those
same steps at: the fit spans every timed step, where one probe right after them caught a moment
(here 10 % faster than the fit priced the probe's steps, so a later probe at the fit's speed read
as a host 9 % slow)."""

from __future__ import annotations

import math
import statistics

from shoal.engine.step_shape import StepShape
from shoal.engine.step_trace import Gap
from shoal.sim.profile import NodeProfile
from shoal.sim.servers import in_fresh_engine

PROBE_PROMPT = 512  # tokens of each lone prompt (less where the context is shorter)
PROBE_ROWS, PROBE_STEPS = 4, 16  # then this many 128-token requests decode this many tokens
PROBE_ROUNDS = 2
# The seed of a probe on an engine that ran the profile's steps: prompts of their own, so that none
# hits a prefix the profile's left in the cache (a probe's steps are then those of a fresh engine).
IN_PROFILE_SEED = 7919


def run_probe(engine, seed: int = 0) -> list[tuple[StepShape, float]]:
    """The probe's steps on this engine, each timed (after one warm-up request)."""
    from shoal.sim.step_samples import StepRecorder

    rec = StepRecorder(engine, seed)
    rec.add(64, 4)
    rec.run(record=False)
    prompt = min(PROBE_PROMPT, engine.max_model_len - PROBE_STEPS - 1)
    for _ in range(PROBE_ROUNDS):
        rec.add(prompt, 1)
        rec.run()
        for _ in range(PROBE_ROWS):
            rec.add(128, PROBE_STEPS)
        rec.run()
    return rec.samples


def probe_seconds(engine_options: dict, seed: int = 0) -> float:
    """The seconds of run_probe's steps on a fresh engine of these options (LLM(**options)), in a
    process of its own."""
    then = (
        "from shoal.sim.speed_probe import run_probe; "
        "print(sum(t for _, t in run_probe(llm.engine, int(sys.argv[2]))))"
    )
    return float(in_fresh_engine(f"{then}; llm.shutdown()", engine_options, str(seed)).split()[-1])


def price_probe(profile: NodeProfile, engine) -> tuple[float, float]:
    """What `profile`'s step costs price the probe's steps at (the reference of probe_seconds), and
    what they took on `engine`, the engine those costs were fitted on, right then."""
    steps = run_probe(engine, IN_PROFILE_SEED)
    return sum(profile.step_seconds(s) for s, _ in steps), sum(t for _, t in steps)


def host_speed(profile: NodeProfile, engine_options: dict) -> float:
    """How many times as slow as its profile's steps this host runs the engine now (a probe)."""
    if profile.probe_s is None:
        raise ValueError("this profile has no speed probe: take it without --no-speed-probe")
    return probe_seconds(engine_options) / profile.probe_s


STEP_KINDS = ("decode", "prompt")  # decode-only steps, and steps with prompt tokens


def step_kind(shape: StepShape) -> str:
    return "decode" if shape.decode_only else "prompt"


def served_ratios(profile: NodeProfile, steps: list[tuple[StepShape, float]]) -> dict[str, float]:
    """Of each kind of step (decode-only, with prompt tokens), how many times what `profile` prices
    them at the traced steps took: in a calibration's served runs, what serving's own work beside
    a step (streams, HTTP) stretched it by (here decode steps 3-4 % under their price, the inter-step
    work being in it, prompt steps 5-20 % over), which a profile keeps to describe itself: the
    kinds' traced speeds with no gaps between the steps read."""
    return traced_kind_speeds(profile, steps) if steps else {}


# A gap between two traced steps after which the engine had nothing left to run is its own work
# (its outputs, a prefill worker's handoffs: 0.3 ms a decode step, 20-24 ms after a 512-token
# prefill here) under this; over it, the engine waited for work. After a step that left work
# pending, the whole gap is its own work, however long: a prefill worker packs the K/V of each
# prompt its step ran (12-15 ms each on this host), so after four the gap was 48-104 ms, and this
# bound alone had left those out and read the worker 1-2 % fast (README, run 44).
BUSY_GAP_S = 0.05


def traced_speed(
    profile: NodeProfile,
    steps: list[tuple[StepShape, float]],
    gaps: list[Gap] = (),
    charged_s: float = 0.0,
) -> float:
    """How many times its profile's prices an engine that traced these steps (read_steps and
    read_gaps of a file in its SHOAL_STEP_TRACE_DIR) was busy on them: their own seconds and, after
    each, the engine's work between two steps (_work_between's mean), less what
    the simulator charges for that work beside the steps' prices (`charged_s`: a prefill worker's
    packing of its handoffs). The simulator pricing the same steps at this is as busy as the real
    engine was, and a queue's wait follows that. Read from the serving process itself, over the
    whole run, where a probe reads a moment before or after it. The calibration's served-step
    ratios (served_ratios) are not taken out: set against them (prompt steps ran 6-10 % over their
    price there, mostly beside streams), a P/D fleet's simulated prefill worker was busy 11 % less
    than the real one and its TTFT p50 came out 19 % low (README, run 36)."""
    if not steps:
        raise ValueError("no engine steps were traced")
    return _busy_over_price(profile, steps, _work_between(gaps), charged_s)


def traced_kind_speeds(
    profile: NodeProfile,
    steps: list[tuple[StepShape, float]],
    gaps: list[Gap] = (),
    charged_s: float = 0.0,
) -> dict[str, float]:
    """traced_speed of each kind of step apart (decode-only, with prompt tokens), the engine's
    work between two steps shared evenly among them, `charged_s` (a prefill worker's packing,
    which follows its prompts) taken from the prompt steps. The two kinds wait on different parts
    of the host (a prompt's products on the core, a decode step on memory), and its load moves
    them apart: in one pool's run here, through a burst, prompt steps ran x1.04 their price and
    decode steps x0.94, where the engine as a whole read x0.97; one speed for both priced the
    burst's prompts 7 % low, and its requests' TTFT p99 came out 21 % short (11 % by kind; over
    a whole benchmark, README run 41, it mended the one-replica rows more than the pool)."""
    if not steps:
        raise ValueError("no engine steps were traced")
    between = _work_between(gaps)
    out = {}
    for kind in STEP_KINDS:
        mine = [(s, t) for s, t in steps if step_kind(s) == kind]
        if mine:
            out[kind] = _busy_over_price(profile, mine, between, charged_s if kind == "prompt" else 0.0)
    return out


def _busy_over_price(
    profile: NodeProfile, steps: list[tuple[StepShape, float]], between: float, charged_s: float
) -> float:
    """The steps' seconds, `between` after each, less `charged_s`, over their prices."""
    busy = sum(t for _, t in steps) + len(steps) * between - charged_s
    return busy / sum(profile.step_seconds(s) for s, _ in steps)


def _work_between(gaps: list[Gap]) -> float:
    """The engine's mean work between two steps: the gaps after steps that left work pending, and
    the others under BUSY_GAP_S."""
    busy = [g.seconds for g in gaps if g.seconds >= 0 and (g.pending or g.seconds < BUSY_GAP_S)]
    return sum(busy) / len(busy) if busy else 0.0


def traced_noise(profile: NodeProfile, steps: list[tuple[StepShape, float]]) -> dict[str, float]:
    """How far each kind of traced step strayed from its price, step to step: the standard
    deviation of log(seconds / price) (ReplicaShape's step noise). Decode steps of 16 streams on
    this 2-core host: 0.15 (their 10th and 90th percentiles x0.85 and x1.23 of the mean), with next
    to no correlation from one step to the next (0.09); prompt steps 0.065. A simulator pricing
    every step exactly puts each closed-loop client's next request at the same point of a step, and
    a TTFT p50 on one edge of a cliff between two waits (README, run 38)."""
    out = {}
    for kind in STEP_KINDS:
        logs = [math.log(t / profile.step_seconds(s)) for s, t in steps if step_kind(s) == kind and t > 0]
        if len(logs) > 1:
            out[kind] = statistics.pstdev(logs)
    return out
