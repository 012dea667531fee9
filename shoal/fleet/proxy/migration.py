"""The first phase of moving a stream live (issue 29): its context is copied to the replica it
moves to while it goes on decoding where it is.

The copy is a request of the target's own: the context as a prompt of token ids, one token to
generate, its K/V fetched from the source over the K/V transport (`kv_transfer_params` with
`prefix`). When it ends the blocks sit in the target's prefix cache, so the stream's continuation
there finds all but the tokens generated since the copy, and computes those few: the client's
pause is a short prefill, not a transfer of the whole context. A target that fails the copy
leaves the stream where it runs; a source that dies during it leaves the target to compute the
context (the transport's own fallback), and its stream fails over as any other."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import httpx

from shoal.fleet.admission.dispatch import NoReplicaError
from shoal.fleet.proxy.disagg import peer_params
from shoal.fleet.proxy.forward import Forward
from shoal.fleet.proxy.parts import RelayParts
from shoal.fleet.proxy.upstream import Attempt, UpstreamClient
from shoal.fleet.replicas.replica import Replica
from shoal.fleet.routing.policies import RouteRequest

log = logging.getLogger(__name__)


@dataclass
class CopyResult:
    """How a copy ended: "copied"; "refused" (the target would not take the context: a 4xx, so
    nothing is wrong with it); "target_failed" (it failed or died). `ok` is for its circuit."""

    outcome: str
    ok: bool | None = True


def copy_body(model: str | None, context: list[int], source: Replica) -> dict:
    return {
        "model": model,
        "prompt": context,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": peer_params(source),
    }


async def copy_to_another(
    parts: RelayParts,
    fwd: Forward,
    source: Replica,
    contexts: list[list[int]],
    route: RouteRequest,
    exclude: set[str],
) -> tuple[str, Replica | None]:
    """Chooses where a stream moves (by `route`, neither `source` nor `exclude`) and copies its
    choices' `contexts` there: the outcome (see CopyResult, or "no_target") and the replica."""
    try:
        lease = await parts.dispatch.lease(route, exclude | {source.name}, timeout=0)
    except NoReplicaError:
        return "no_target", None
    target = lease.replica
    with lease.held_until_given_back():  # should the copy itself be cancelled
        result = await copy_contexts(
            parts.client,
            parts.prefill.headers(fwd.headers),
            source,
            target,
            fwd.body.get("model"),
            contexts,
            parts.config.first_byte_timeout_s,
        )
    lease.give_back(result.ok, "a stream's context copy failed", result.outcome == "target_failed")
    return result.outcome, target


async def copy_contexts(
    client: UpstreamClient,
    headers: dict,
    source: Replica,
    target: Replica,
    model: str | None,
    contexts: list[list[int]],
    timeout_s: float,
) -> CopyResult:
    """Copies each context's K/V (prompt and output so far, token ids) from `source` into
    `target`'s prefix cache, all at once; the first failure is the result."""
    results = await asyncio.gather(
        *(_copy_one(client, headers, source, target, model, c, timeout_s) for c in contexts)
    )
    return next((r for r in results if r.outcome != "copied"), CopyResult("copied"))


async def _copy_one(
    client: UpstreamClient,
    headers: dict,
    source: Replica,
    target: Replica,
    model: str | None,
    context: list[int],
    timeout_s: float,
) -> CopyResult:
    content = json.dumps(copy_body(model, context, source)).encode()
    attempt = Attempt(target)
    try:
        resp, data = await client.exchange(attempt, "/v1/completions", content, headers, timeout_s)
    except (httpx.HTTPError, TimeoutError) as exc:
        outcome = attempt.outcome(exc)
        log.warning("copying a stream's context to %s failed: %s", target.name, outcome.message)
        return CopyResult("target_failed", None if outcome.kind == "timeout" else False)
    finally:
        attempt.done()
    if resp.status_code != 200:
        log.warning(
            "%s refused a stream's context (HTTP %d): %s",
            target.name,
            resp.status_code,
            data[:200].decode(errors="replace"),
        )
        refused = resp.status_code < 500
        return CopyResult("refused" if refused else "target_failed", refused)
    return CopyResult("copied")
