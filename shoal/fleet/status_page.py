"""The gateway's live status page (GET /status): each pool's replicas and their state, load, KV
usage and queue depth, and the autoscaler's decisions over time. One self-contained page
(static/status.html) that polls GET /fleet/state once a second; with ?key=... it sends that as the
gateway's API key."""

from __future__ import annotations

from functools import cache
from importlib.resources import files


@cache
def status_html() -> str:
    return files("shoal.fleet").joinpath("static/status.html").read_text(encoding="utf-8")
