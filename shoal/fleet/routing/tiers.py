"""The tiers routing policy: a cheap model answers first, a strong one when a rule says so.

A `[[tiers]]` table names a route (the model id clients send), its cheap and strong models and
the rules, checked in order: a hint (header `x-shoal-tier: strong|cheap`, or the body's
`tier`), the prompt's length, then the cheap answer's own confidence: the geometric mean of its
tokens' probabilities, from the logprobs it is asked for (and that are removed again when the
client did not ask). A streamed request cannot be taken back once it has started, so the
confidence rule applies to unstreamed ones; streams follow the hint and length rules.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi.responses import Response

from shoal.protocol.errors import APIError

HINT_HEADER = "x-shoal-tier"


@dataclass
class TierConfig:
    name: str  # the model id clients send for this route
    cheap: str  # the model tried first
    strong: str  # the model it escalates to
    max_prompt_tokens: int = 0  # longer prompts go to the strong model (0: no length rule)
    min_confidence: float = 0.0  # a cheap answer less sure than this is escalated (0: no rule)

    def check(self) -> None:
        if not self.name or not self.cheap or not self.strong:
            raise ValueError("a [[tiers]] table needs name, cheap and strong")
        if not 0 <= self.min_confidence < 1 or self.max_prompt_tokens < 0:
            raise ValueError(f"tiers {self.name}: min_confidence in [0, 1), max_prompt_tokens >= 0")


def confidence(path: str, answer: dict) -> float | None:
    """The least sure choice's geometric-mean token probability, or None without logprobs."""
    worst = None
    for ch in answer.get("choices") or []:
        lp = ch.get("logprobs") or {}
        if path.endswith("chat/completions"):
            values = [t.get("logprob") for t in lp.get("content") or []]
        else:
            values = lp.get("token_logprobs") or []
        values = [v for v in values if isinstance(v, int | float)]
        if not values:
            continue
        c = math.exp(sum(values) / len(values))
        worst = c if worst is None else min(worst, c)
    return worst


def _strip_logprobs(answer: dict) -> None:
    for ch in answer.get("choices") or []:
        ch["logprobs"] = None


# One attempt on a model: (path, body with its model set) -> the response.
Send = Callable[[str, dict], Awaitable[Response]]


class TierRouter:
    def __init__(self, routes: list[TierConfig], metrics):
        for r in routes:
            r.check()
        self.routes = {r.name: r for r in routes}
        self.metrics = metrics

    def get(self, model) -> TierConfig | None:
        return self.routes.get(model) if isinstance(model, str) else None

    def first_choice(
        self, route: TierConfig, body: dict, headers, prompt_tokens: int, may_ask_strong: bool = True
    ) -> tuple[str, str]:
        """(tier, why) before anything runs: strong by a hint or the length, else cheap. A hint
        for the strong model counts only from a tenant allowed that model by name."""
        hint = headers.get(HINT_HEADER) or body.pop("tier", None)
        if hint not in (None, "cheap", "strong"):
            raise APIError(400, f"tier must be cheap or strong, not {str(hint)[:40]!r}", "tier")
        if hint == "cheap" or (hint == "strong" and may_ask_strong):
            return hint, "hint"
        if route.max_prompt_tokens and prompt_tokens > route.max_prompt_tokens:
            return "strong", "length"
        return "cheap", "default"

    async def run(
        self,
        route: TierConfig,
        path: str,
        body: dict,
        headers,
        prompt_tokens: int,
        send: Send,
        may_ask_strong: bool = True,
    ) -> Response:
        tier, why = self.first_choice(route, body, headers, prompt_tokens, may_ask_strong)
        judge = tier == "cheap" and why == "default" and route.min_confidence > 0 and not body.get("stream")
        if tier == "strong":
            return await self._answer(route, "strong", why, path, body, send)
        if not judge:
            return await self._answer(route, "cheap", why, path, body, send)
        asked = body.get("logprobs")
        probe = {**body, "model": route.cheap}
        if path.endswith("chat/completions"):
            probe["logprobs"] = True
        elif not isinstance(asked, int) or isinstance(asked, bool):
            probe["logprobs"] = 0
        resp = await send(path, probe)
        if 400 <= resp.status_code < 500:
            return self._tag(resp, route, "cheap", "default")  # it would fail on either model
        answer = None
        if resp.status_code < 300:
            try:
                answer = json.loads(resp.body)
            except ValueError:
                answer = None
        conf = confidence(path, answer) if isinstance(answer, dict) else None
        if conf is None or conf < route.min_confidence:
            reason = "confidence" if conf is not None else "cheap_failed"
            return await self._answer(route, "strong", reason, path, body, send)
        if not asked:
            _strip_logprobs(answer)
        out = Response(
            json.dumps(answer, ensure_ascii=False).encode(),
            status_code=resp.status_code,
            media_type="application/json",
            headers={
                k: v for k, v in resp.headers.items() if k.lower() not in ("content-length", "content-type")
            },
        )
        out.headers["x-shoal-tier-confidence"] = f"{conf:.4f}"
        return self._tag(out, route, "cheap", "confident")

    async def _answer(self, route: TierConfig, tier: str, why: str, path: str, body: dict, send: Send):
        if tier == "strong":
            self.metrics.tier_escalations.labels(route.name, why).inc()
        resp = await send(path, {**body, "model": route.strong if tier == "strong" else route.cheap})
        return self._tag(resp, route, tier, why)

    def _tag(self, resp: Response, route: TierConfig, tier: str, why: str) -> Response:
        self.metrics.tier_requests.labels(route.name, tier).inc()
        resp.headers["x-shoal-tier"] = tier
        resp.headers["x-shoal-tier-reason"] = why
        return resp
