"""A node's profile: what one replica's step costs as a function of what the step holds, how much
KV it keeps, and how long it takes to start. `shoal profile` measures it (profiler.py); the
simulator and the planner read it."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from shoal.engine.step_shape import StepShape

# The features of the two cost models (see StepCost.row). tokens_sq, the square of a step's prompt
# and decode tokens: per token, a step of several prompts costs more than a lone prompt (here, on
# one core, 0.98 ms a token for one 512-token prompt, 1.26 for four in one step: the step's
# activations outgrow the caches). Profiles taken before it have the first four features only.
DECODE_FEATURES = ("step", "rows", "context")
MIXED_FEATURES = ("step", "rows", "tokens", "attention", "tokens_sq")


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of relative error with every coefficient at least 0 (a cost never falls as a
    step holds more): drop the most negative coefficient and fit again until none is."""
    w = 1.0 / np.maximum(y, 1e-6)  # relative: a 2 ms step matters as much as a 200 ms one
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def interpolation_weights(x: float, knots: list[int]) -> list[float]:
    """Weights of the knots whose sum of weight x value interpolates linearly between the two
    knots around x (beyond the last, it extends the last two's line)."""
    w = [0.0] * len(knots)
    if len(knots) == 1 or x <= knots[0]:
        w[0] = 1.0
        return w
    i = next((j for j in range(len(knots) - 1) if x <= knots[j + 1]), len(knots) - 2)
    t = (x - knots[i]) / (knots[i + 1] - knots[i])
    w[i], w[i + 1] = 1.0 - t, t
    return w


@dataclass
class StepCost:
    """A cost model of one kind of step (decode-only, or with prompt tokens): linear in the step's
    features, or (with `knots`) the cost of its rows interpolated between measured row counts plus
    a cost per token of context: a CPU's kernels change path with the batch, a line does not."""

    features: tuple[str, ...]
    coef: list[float]
    samples: int = 0
    # Median and 90th percentile of |predicted - measured| / measured over the samples it was fit on.
    error_p50: float = 0.0
    error_p90: float = 0.0
    knots: list[int] = field(default_factory=list)

    def row(self, shape: StepShape) -> list[float]:
        """The shape's features as this model reads them (a step with a one-token prompt chunk
        looks like a decode, but the prompt step's model prices it)."""
        if self.knots:
            return [*interpolation_weights(shape.rows, self.knots), shape.context]
        if self.features[:4] == MIXED_FEATURES[:4]:
            return [1.0, shape.rows, shape.tokens, shape.attention, shape.tokens**2][: len(self.features)]
        return [1.0, shape.rows, shape.context]

    @classmethod
    def fit(
        cls,
        names: tuple[str, ...],
        shapes: list[StepShape],
        seconds: list[float],
        knots: list[int] | None = None,
    ) -> StepCost:
        if not shapes:
            raise ValueError(f"no samples to fit a step cost over {names}")
        if knots:
            names = (*(f"rows={k}" for k in knots), "context")
        model = cls(names, [], knots=list(knots or []))
        x = np.array([model.row(s) for s in shapes], dtype=float)
        y = np.array(seconds, dtype=float)
        coef = fit_nonnegative(x, y)
        err = np.abs(x @ coef - y) / y
        model.coef = coef.tolist()
        model.samples, model.error_p50, model.error_p90 = (
            len(y),
            float(np.median(err)),
            float(np.percentile(err, 90)),
        )
        return model

    def __post_init__(self):
        self._by_rows: dict[int, float] = {}  # with knots: the cost of a row count, summed once
        self._by_rows_of: list[float] = self.coef  # ... of these coefficients

    def seconds(self, shape: StepShape) -> float:
        return float(sum(c * f for c, f in zip(self.coef, self.row(shape))))

    def cost(self, rows: int, tokens: int, context: int, attention: int) -> float:
        """`seconds` of a step of these features, without a StepShape (the fast simulator prices
        millions of steps); the same sums in the same order, so the same figure to the bit."""
        c = self.coef
        if self.knots:
            if self._by_rows_of is not c:  # the coefficients were replaced (a calibration)
                self._by_rows, self._by_rows_of = {}, c
            base = self._by_rows.get(rows)
            if base is None:
                weights = interpolation_weights(rows, self.knots)
                base = self._by_rows[rows] = sum(ci * w for ci, w in zip(c, weights))
            return float(base + c[-1] * context)
        if self.features[:4] == MIXED_FEATURES[:4]:
            cost = 0 + c[0] * 1.0 + c[1] * rows + c[2] * tokens + c[3] * attention
            return float(cost + c[4] * tokens**2 if len(c) > 4 else cost)
        return float(0 + c[0] * 1.0 + c[1] * rows + c[2] * context)

    def decode_seconds(self, rows: int, context: int) -> float:
        """A decode step of `rows` rows attending to `context` tokens in all."""
        return self.cost(rows, rows, context, context)

    @property
    def per_context_token(self) -> float:
        return self.coef[-1]


@dataclass
class NodeProfile:
    """One replica of a model in one mode and parallel shape, on one machine."""

    machine: str  # CPU model or GPU name, as measured on
    device: str  # "cpu" or "cuda"
    shoal_version: str
    model: str
    quantization: str | None
    tensor_parallel: int
    pipeline_parallel: int
    num_threads: int | None
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    max_num_seqs: int  # the scheduler's settings it was measured under
    max_num_batched_tokens: int
    decode: StepCost
    mixed: StepCost
    startup_s: dict[str, float] = field(default_factory=dict)  # "first" and "again": a replica's start
    # A K/V handoff from a prefill worker: bytes_per_token; per transport (shm, tcp) the fixed
    # seconds of one and the seconds per MiB; and the same of the CPU it takes of the prefill and
    # of the decode worker, `prefill_cpu` and `decode_cpu` (see kv_handoff.py).
    kv_transfer: dict[str, float] = field(default_factory=dict)
    # What serving adds (already in the step costs above, and per request), from a real server;
    # calibrated through a gateway, also the CPU its front spends a token and the host's cores.
    serving: dict[str, float] = field(default_factory=dict)
    measured_at: str = ""
    # The speed probe's steps (speed_probe.py) as the bare step costs above price them: the
    # reference against which the host's speed is measured later; and what they took right after
    # the steps above were timed (the fit's error on them, and that moment's speed).
    probe_s: float | None = None
    probe_timed_s: float | None = None

    def kv_transfer_seconds(self, tokens: int, transport: str = "shm") -> float | None:
        """What handing `tokens` tokens' K/V to a decode worker takes (None: not measured)."""
        return self._handoff_line(transport, tokens)

    def _handoff_line(self, key: str, tokens: int) -> float | None:
        """A measured line of kv_transfer (`key`_s fixed, `key`_s_per_mib) at `tokens` tokens."""
        t = self.kv_transfer
        if f"{key}_s" not in t:
            return None
        return t[f"{key}_s"] + t[f"{key}_s_per_mib"] * tokens * t["bytes_per_token"] / 2**20

    def kv_handoff_cpu_seconds(self, tokens: int, side: str) -> float:
        """CPU seconds a handoff of `tokens` tokens' K/V takes of the `side` ("prefill" or "decode")
        worker: its engine packing or loading the K/V, its front writing or reading it (0: not
        measured)."""
        seconds = self._handoff_line(f"{side}_cpu", tokens)
        return 0.0 if seconds is None else seconds

    def step_seconds(self, shape: StepShape) -> float:
        return (self.decode if shape.decode_only else self.mixed).seconds(shape)

    def at_speed(self, factor: float) -> NodeProfile:
        """This profile on a host `factor` times as slow as its steps were timed (the speed probe's
        seconds now over their price, speed_probe.host_speed): every step costs that much more;
        what serving adds per request, the handoffs and the start-up are left as measured."""
        return self.at_speeds(factor, factor)

    def at_speeds(self, decode: float, prompt: float) -> NodeProfile:
        """at_speed, decode-only steps at one factor and steps with prompt tokens at another."""
        out = copy.deepcopy(self)
        out.decode.coef = [c * decode for c in out.decode.coef]
        out.mixed.coef = [c * prompt for c in out.mixed.coef]
        return out

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> NodeProfile:
        try:
            raw = json.loads(Path(path).read_text())
            for kind in ("decode", "mixed"):
                raw[kind] = StepCost(**{**raw[kind], "features": tuple(raw[kind]["features"])})
            return cls(**raw)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a shoal node profile ({exc})") from exc

    def describe(self) -> str:
        mode = self.quantization or "fp32"
        shape = f"tp{self.tensor_parallel} pp{self.pipeline_parallel}"
        lines = [
            f"profile of {self.model} ({mode}, {shape}) on {self.machine} ({self.device}), "
            f"shoal {self.shoal_version}",
            f"KV: {self.num_kv_blocks} blocks of {self.block_size} tokens ({self.kv_tokens} tokens), "
            f"context {self.max_model_len}",
        ]
        # A decode sample is a run of steps of one batch (profiler.merge_decode_runs).
        for name, cost, unit in (("decode step", self.decode, "runs"), ("mixed step", self.mixed, "steps")):
            if cost.knots:
                terms = ", ".join(f"{k} rows {c * 1e3:.3g} ms" for k, c in zip(cost.knots, cost.coef))
                terms += f"; + {cost.per_context_token * 1e3:.4g} ms x context"
            else:
                terms = " + ".join(f"{c * 1e3:.4g} ms x {f}" for c, f in zip(cost.coef, cost.features))
            lines.append(
                f"{name:<12}: {terms}  ({cost.samples} {unit}, error p50 {100 * cost.error_p50:.1f} %, "
                f"p90 {100 * cost.error_p90:.1f} %)"
            )
        if self.probe_s is not None:
            timed = f", took {self.probe_timed_s:.2f} s right after" if self.probe_timed_s else ""
            lines.append(f"speed probe : {self.probe_s:.2f} s by the bare steps{timed} (a fixed run)")
        if self.startup_s:
            lines.append("start-up    : " + ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_s.items()))
        if "per_step_s" in self.serving:
            lines.append(
                f"serving adds: {1e3 * self.serving['per_step_s']:.2f} ms a step, "
                f"{1e3 * self.serving['per_row_s']:.2f} ms a row, "
                f"{1e3 * self.serving['per_request_s']:.1f} ms a request"
                + (
                    f", x{self.serving['prompt_scale']:.2f} a prompt token"
                    if "prompt_scale" in self.serving
                    else ""
                )
            )
        if "decode_step_ratio" in self.serving:
            lines.append(
                f"served steps: decode x{self.serving['decode_step_ratio']:.3f}, prompt "
                f"x{self.serving['prompt_step_ratio']:.3f} their price, timed by the engine"
            )
        if "front_cpu_s_per_token" in self.serving:
            lines.append(
                f"front CPU   : {1e3 * self.serving['front_cpu_s_per_token']:.3f} ms a token streamed "
                f"(gateway and clients, on {self.serving['cores']:.0f} cores)"
                + (
                    f", and {1e3 * self.serving['gateway_idle_cpu_s_per_s']:.0f} ms a second idle"
                    if "gateway_idle_cpu_s_per_s" in self.serving
                    else ""
                )
                + (
                    f"; the gateway's alone {1e3 * self.serving['gateway_cpu_s_per_token']:.3f} ms a token"
                    if "gateway_cpu_s_per_token" in self.serving
                    else ""
                )
            )
        t = self.kv_transfer

        def line(key: str) -> str:
            return f"{1e3 * t[f'{key}_s']:.2f} ms + {1e3 * t[f'{key}_s_per_mib']:.2f} ms/MiB"

        if any(f"{way}_s" in t for way in ("shm", "tcp")):
            ways = [f"{way} {line(way)}" for way in ("shm", "tcp") if f"{way}_s" in t]
            lines.append(f"KV transfer : {t['bytes_per_token']:.0f} B a token; " + "; ".join(ways))
        if "prefill_cpu_s" in t:
            sides = [f"{side} worker {line(f'{side}_cpu')}" for side in ("prefill", "decode")]
            lines.append("handoff CPU : " + "; ".join(sides))
        return "\n".join(lines)


def made_up_profile(num_blocks: int = 4096, max_model_len: int = 2048, block_size: int = 16) -> NodeProfile:
    """A profile of made-up costs (10 ms a step, 0.5 ms a row, 0.2 ms a prompt token) of a small
    model's shape: for examples, tests of the simulator's rules, and its speed at scale, none of
    which depends on what a step costs."""
    return NodeProfile(
        machine="made up",
        device="cpu",
        shoal_version="-",
        model="made up",
        quantization=None,
        tensor_parallel=1,
        pipeline_parallel=1,
        num_threads=None,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        decode=StepCost(DECODE_FEATURES, [0.010, 0.0005, 1e-7]),
        mixed=StepCost(MIXED_FEATURES, [0.010, 0.0005, 0.0002, 1e-9, 0.0]),
    )
