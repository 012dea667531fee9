"""Seeded per-position randomness.

The noise that picks a request's token at position p comes from a generator seeded with
(its seed, p) and nothing else, and every path that picks a token uses it the same way: a plain
decode, each row of a verify pass over k proposed tokens, the token after a rejected proposal.
So a seeded request draws the same tokens whatever shares its batch, whether or not proposals
rode along, after a preemption or a retried step, and on another replica that resumes it.
"""

from __future__ import annotations

import torch

from shoal.protocol.seeds import derive_seed


def position_generator(seed: int, position: int, generator: torch.Generator | None = None) -> torch.Generator:
    """The generator for the draw at `position` (reseeds `generator` when given, to reuse it)."""
    return (generator or torch.Generator()).manual_seed(derive_seed(seed, position))


def exponential_race(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token from `probs` (unnormalised is fine) by the exponential race: argmax(p / E) with
    E ~ Exp(1) samples from p. One noise value per token of the vocabulary, drawn in the same
    order every time, so the same generator state picks the same token from the same p."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())
