"""Latency and throughput figures of a `shoal bench serve` run, and its optional plot."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    start: float  # seconds since the run began
    input_len: int
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk, since start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile_stats(values) -> dict[str, float | None]:
    arr = np.asarray(values, dtype=float)
    if not arr.size:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(
    records: list[RequestRecord], duration: float, slo_ttft: float | None, slo_tpot: float | None
) -> dict:
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    nan = float("nan")
    return summary_of(
        CompletedRequests(
            np.array([r.input_len for r in ok], dtype=float),
            np.array([r.output_tokens for r in ok], dtype=float),
            np.array([nan if r.ttft is None else r.ttft for r in ok], dtype=float),
            np.array([nan if r.e2e is None else r.e2e for r in ok], dtype=float),
        ),
        len(records),
        errors,
        duration,
        percentile_stats([x for r in ok for x in r.itls]),
        slo_ttft,
        slo_tpot,
    )


@dataclass
class CompletedRequests:
    """The figures of the requests that completed, one array entry each (NaN: not known)."""

    input_len: np.ndarray
    output_tokens: np.ndarray
    ttft: np.ndarray
    e2e: np.ndarray

    @property
    def tpot(self) -> np.ndarray:
        """Time per output token after the first (NaN where there is no second token)."""
        many = (self.output_tokens >= 2) & ~np.isnan(self.ttft) & ~np.isnan(self.e2e)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(many, (self.e2e - self.ttft) / (self.output_tokens - 1), np.nan)


def summary_of(
    done: CompletedRequests,
    requests: int,
    errors: dict[str, int],
    duration: float,
    itl: dict[str, float | None],
    slo_ttft: float | None,
    slo_tpot: float | None,
) -> dict:
    """The report of a run (`shoal bench serve`'s, and the simulators'): `itl` is already summed
    up, since a simulator keeps inter-token times as a histogram."""
    completed = len(done.e2e)
    out_tokens, in_tokens = int(done.output_tokens.sum()), int(done.input_len.sum())
    tpot = done.tpot
    meets = np.ones(completed, dtype=bool)
    if slo_ttft is not None:
        meets &= np.nan_to_num(done.ttft) <= slo_ttft
    if slo_tpot is not None:
        meets &= np.nan_to_num(tpot) <= slo_tpot
    return {
        "requests": requests,
        "completed": completed,
        "failed": requests - completed,
        "errors": errors,
        "duration_s": duration,
        "request_throughput": completed / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + in_tokens) / duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "goodput": int(meets.sum()) / duration if (slo_ttft or slo_tpot) else None,
        "ttft_s": percentile_stats(done.ttft[~np.isnan(done.ttft)]),
        "tpot_s": percentile_stats(tpot[~np.isnan(tpot)]),
        "itl_s": itl,
        "e2e_s": percentile_stats(done.e2e[~np.isnan(done.e2e)]),
    }


def format_summary(s: dict) -> str:
    lines = [
        f"requests        : {s['completed']} ok / {s['requests']} ({s['failed']} failed {s['errors'] or ''})",
        f"duration        : {s['duration_s']:.2f} s",
        f"throughput      : {s['request_throughput']:.2f} req/s, "
        f"{s['output_token_throughput']:.1f} output tok/s, {s['total_token_throughput']:.1f} total tok/s",
    ]
    if s["goodput"] is not None:
        lines.append(f"goodput         : {s['goodput']:.2f} req/s within the SLOs")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        st = s[key]
        if st["mean"] is None:
            continue
        cells = "  ".join(f"p{p} {1000 * st[f'p{p}']:8.1f}" for p in PERCENTILES)
        lines.append(f"{label:<5} ms       : mean {1000 * st['mean']:8.1f}  {cells}")
    if s.get("client_cpu_s") is not None:
        busy = s["client_cpu_s"] / s["duration_s"]
        lines.append(f"client CPU      : {s['client_cpu_s']:.2f} s ({100 * busy:.0f} % of a core)")
    return "\n".join(lines)


def plot(records: list[RequestRecord], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'shoal[plot]'") from exc
    ok = [r for r in records if r.ok]
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    ax[0, 0].scatter([r.start for r in ok], [r.ttft for r in ok], s=8)
    ax[0, 0].set(title="TTFT over the run", xlabel="request start (s)", ylabel="TTFT (s)")
    ax[0, 1].scatter([r.start for r in ok], [r.e2e for r in ok], s=8, color="tab:orange")
    ax[0, 1].set(title="End-to-end latency over the run", xlabel="request start (s)", ylabel="E2E (s)")
    for axis, values, title in (
        (ax[1, 0], [r.ttft for r in ok], "TTFT CDF"),
        (ax[1, 1], [x for r in ok for x in r.itls], "ITL CDF"),
    ):
        if values:
            v = np.sort(values)
            axis.plot(v, np.arange(1, len(v) + 1) / len(v))
        axis.set(title=title, xlabel="seconds", ylabel="fraction")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
