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


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(
    records: list[RequestRecord], duration: float, slo_ttft: float | None, slo_tpot: float | None
) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_len for r in ok)

    def meets(r: RequestRecord) -> bool:
        tpot = r.tpot or 0.0
        return (slo_ttft is None or (r.ttft or 0) <= slo_ttft) and (slo_tpot is None or tpot <= slo_tpot)

    good = [r for r in ok if meets(r)]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + in_tokens) / duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "goodput": len(good) / duration if (slo_ttft or slo_tpot) else None,
        "ttft_s": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": _stats([x for r in ok for x in r.itls]),
        "e2e_s": _stats([r.e2e for r in ok if r.e2e is not None]),
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
