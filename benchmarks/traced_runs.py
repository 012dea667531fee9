"""The accuracy benchmark's reading of a real run's traced steps (SHOAL_STEP_TRACE_DIR): each role's
speed by kind of step, how it moved over the run, and how far steps strayed from their price."""

from __future__ import annotations

from shoal.engine.step_trace import read_gaps, read_timed_steps, step_trace_files
from shoal.sim.drift import SpeedDrift
from shoal.sim.speed_probe import STEP_KINDS, traced_kind_speeds, traced_noise

Traces = list[tuple[list, list]]  # each engine's traced steps and the gaps between them


def read_traces(trace_dir: str) -> Traces:
    """Each engine's traced steps (with when each ended) and the gaps between them, read once for
    every figure of a run."""
    return [(read_timed_steps(path), read_gaps(path)) for path in step_trace_files(trace_dir)]


def by_role(traces: Traces) -> dict[str, tuple[list, list]]:
    """The traced steps and gaps of each role: a P/D fleet's prefill workers are those whose steps
    all held prompt tokens (each request samples its first token there and leaves), its decode
    workers the rest; a fleet of whole replicas is one role, "both"."""
    out: dict[str, tuple[list, list]] = {}
    split = any(steps and all(not s.decode_only for s, _, _ in steps) for steps, _ in traces)
    for steps, gaps in traces:
        role = ("prefill" if all(not s.decode_only for s, _, _ in steps) else "decode") if split else "both"
        mine = out.setdefault(role, ([], []))
        mine[0].extend(steps)
        mine[1].extend(gaps)
    return out


def traced_speeds(profile, traces: Traces, handed: list[int] = ()) -> dict[str, dict[str, float]]:
    """Each role's speed for each kind of step (speed_probe.traced_kind_speeds) from the steps its
    engines traced and the gaps between them (by_role). `handed`: the prompts' lengths whose K/V
    the prefill workers handed on, whose packing the simulator charges between their steps."""
    packing = sum(profile.kv_handoff_cpu_seconds(n, "prefill") for n in handed)
    out = {}
    for role, (timed, gaps) in by_role(traces).items():
        if steps := [(shape, seconds) for shape, seconds, _ in timed]:
            kinds = traced_kind_speeds(profile, steps, gaps, packing if role == "prefill" else 0.0)
            # A role that ran one kind alone (a prefill worker's prompts) prices the other as it.
            out[role] = {kind: kinds.get(kind, next(iter(kinds.values()))) for kind in STEP_KINDS}
    return out


def traced_drifts(profile, traces: Traces) -> dict[str, SpeedDrift]:
    """How each role's speed moved over the run (drift.py), from its first step on."""
    start = min(
        ended - seconds for steps, _ in traces for _, seconds, ended in steps[:1] if ended is not None
    )
    return {role: SpeedDrift.traced(profile, timed, start) for role, (timed, _) in by_role(traces).items()}


def step_noise(profile, traces: Traces) -> dict[str, float]:
    """How far the run's traced steps of each kind strayed from their price (traced_noise), every
    engine's steps together."""
    return traced_noise(profile, [(shape, t) for steps, _ in traces for shape, t, _ in steps])
