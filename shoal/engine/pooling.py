"""Embeddings of prompts: a request's final hidden states (after the model's last norm), pooled
as it asks and L2-normalized, gathered chunk by chunk as its prompt is computed."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class PromptPooler:
    def __init__(self, norm: Callable[[torch.Tensor], torch.Tensor] | None):
        self.norm = norm
        self.modes: dict[str, str] = {}  # request id -> "mean" | "last"
        # request id -> {chunk's first position: its rows' sum}: a chunk computed again replaces
        # the sums from its position on instead of adding them twice.
        self.sums: dict[str, dict[int, torch.Tensor]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.modes

    def __bool__(self) -> bool:
        return bool(self.modes)

    def add(self, request_id: str, mode: str) -> None:
        self.modes[request_id] = mode

    def drop(self, request_id: str) -> None:
        self.modes.pop(request_id, None)
        self.sums.pop(request_id, None)

    def take(self, request_id: str, rows: torch.Tensor, start_pos: int, prompt_len: int):
        """Pools a chunk's rows (its prompt positions from `start_pos`): the embedding (a list of
        floats) once the chunk ends the prompt, else None."""
        ends = start_pos + len(rows) >= prompt_len
        if self.modes[request_id] == "last":
            return _unit(self.norm(rows[-1:])[0]) if ends else None
        sums = self.sums.setdefault(request_id, {})
        for later in [p for p in sums if p >= start_pos]:  # an earlier try's (a retried step, or
            del sums[later]  # a preempted request computing its prompt again from the start)
        sums[start_pos] = self.norm(rows).to(torch.float64).sum(0)
        if not ends:
            return None
        total = torch.stack(list(sums.values())).sum(0) / prompt_len
        del self.sums[request_id]
        return _unit(total)


def _unit(v: torch.Tensor) -> list[float]:
    return F.normalize(v.to(torch.float64), dim=0).tolist()
