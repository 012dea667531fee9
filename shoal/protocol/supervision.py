"""How a replica knows it is still wanted: its supervisor's pid (a fleet whose replicas die with
it), or a lifeline (a fleet of several gateways, whose replicas outlive any one of them): the
replica exits once no gateway has probed it for that long."""

from __future__ import annotations

PARENT_PID_ENV = "SHOAL_PARENT_PID"  # exit when this process is no longer the parent
LIFELINE_ENV = "SHOAL_LIFELINE_S"  # exit after this many seconds without a gateway's request
GATEWAY_HEADER = "x-shoal-gateway"  # sent by every gateway's probes: a sign of life
