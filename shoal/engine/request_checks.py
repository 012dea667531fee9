"""What the engine refuses a request for, and the check of its token ids (apart from the core,
which raises these)."""

from __future__ import annotations

from shoal.engine.sampling_params import InvalidParamError, SamplingParams


class EngineBrokenError(RuntimeError):
    """Every request of several steps in a row failed: the process should be restarted."""


class RequestRejectedError(InvalidParamError):
    """A request that can never be served (too long, bad tokens, duplicate id)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message, param)
        self.code = code


def check_token_ids(vocab: int, ids: list[int], prior: list[int], params: SamplingParams) -> None:
    """Every token id a request names is in the vocabulary [0, vocab), or RequestRejectedError."""
    named = {
        "prompt": ids,
        "prior_output_ids": prior,
        "stop_token_ids": params.stop_token_ids,
        "logit_bias": params.logit_bias,
        "allowed_token_ids": params.allowed_token_ids or (),
    }
    for name, tokens in named.items():
        bad = next((t for t in tokens if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejectedError(f"token id {bad!r} is outside the vocabulary [0, {vocab})", name)
