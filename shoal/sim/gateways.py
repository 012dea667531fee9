"""How many gateways a fleet's traffic needs: each relays every token its requests stream, and a
gateway is one process with one event loop, so one core at most. The CPU a token costs a gateway
is what the profile's serving calibration measured of its gateway (`shoal profile
--through-gateway`), per token streamed: its requests' routing and parsing are spread over their
tokens (48 a request there), so a workload of shorter answers costs more a token than that, and
a P/D fleet's gateways, which also ask a prefill worker for each prompt, more again."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.protocol.bounds import check_bounds
from shoal.sim.profile import NodeProfile


@dataclass
class GatewaySizing:
    # A gateway kept under this share of its one core: past it, requests queue on its event loop
    # and every stream's tokens wait behind the others'.
    busy: float = 0.7
    spares: int = 1  # gateways beyond the load's: the fleet keeps answering when one dies

    def __post_init__(self):
        check_bounds(self, {"spares": 0}, above={"busy": 0}, most={"busy": 1})


@dataclass
class GatewayPlan:
    gateways: int
    cores: float  # CPU the load's tokens take of the gateways, in cores
    notes: list[str]


def size_gateways(
    profile: NodeProfile, rate: float, output_tokens: float, sizing: GatewaySizing | None = None
) -> GatewayPlan | None:
    """The gateways for `rate` requests/s of `output_tokens` each, and the arithmetic; None: the
    profile did not time a gateway."""
    per_token = profile.serving.get("gateway_cpu_s_per_token")
    if per_token is None:
        return None
    sizing = sizing or GatewaySizing()
    tokens = rate * output_tokens
    cores = tokens * per_token
    needed = max(1, math.ceil(cores / sizing.busy))
    notes = [
        f"the gateways relay {rate:.2f} x {output_tokens:g} = {tokens:,.0f} tokens/s; a token takes "
        f"{1e3 * per_token:.3f} ms of a gateway's CPU (the profile's calibration), so "
        f"{cores:.2f} cores",
        f"a gateway is one event loop: at {100 * sizing.busy:.0f} % of a core each, {needed}, "
        f"and {sizing.spares} to lose: {needed + sizing.spares} gateways",
    ]
    return GatewayPlan(needed + sizing.spares, cores, notes)
