"""A record of the requests the gateway served, one JSON line each (arrival, prompt and output
tokens, tenant, model, priority, the prompt's block hashes, outcome): what `shoal sim --trace`
replays. Written as each request ends; the lines of one run are in the order requests ended."""

from __future__ import annotations

import json
import logging
import time
from typing import IO

from shoal.fleet.proxy.forward import Forward

log = logging.getLogger(__name__)


class WorkloadTrace:
    def __init__(self, path: str):
        self.path = path
        self._file: IO[str] | None = open(path, "a", buffering=1)  # noqa: SIM115  (closed by close())
        # Arrivals are stamped in wall-clock seconds, so traces of several gateways line up.
        self._offset = time.time() - time.monotonic()

    def record(self, fwd: Forward, tenant: str) -> None:
        if self._file is None:
            return
        prompt, completion = fwd.usage
        route = fwd.route
        line = {
            "t": round(fwd.started + self._offset, 6),
            "input_len": prompt or route.tokens,
            "output_len": completion,
            "tenant": tenant,
            "model": route.model or fwd.body.get("model"),
            "priority": route.priority,
            "path": fwd.path,
            "ok": completion > 0,
            "block_hashes": route.hashes,
        }
        try:
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        except OSError as exc:  # a full disk stops the trace, never the request
            log.warning("the workload trace %s stopped: %s", self.path, exc)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
