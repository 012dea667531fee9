"""shoal's `resume` extension, for a gateway continuing a stream whose replica died: the prompt
as token ids, the tokens already streamed for choice `index`, and how many characters of its text
the client already has. The gateway writes it (proxy/stream_state.py), a replica reads it."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

TokenId = Annotated[StrictInt, Field(ge=0, le=2**31)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
RESUME_FIELD = "resume"  # the request field that carries it


class Resume(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    prompt_token_ids: TokenIds
    output_token_ids: list[TokenId] = Field(default_factory=list)
    index: Annotated[StrictInt, Field(ge=0, le=255)] = 0
    text_offset: Annotated[StrictInt, Field(ge=0)] = 0

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # As for every field of a request: null means "not given".
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k == "prompt_token_ids"}
        return data


def resume_field(prompt_ids: list[int], output_ids: list[int], index: int, text_offset: int) -> dict:
    """The `resume` value a gateway sends (as it is: the replica validates it)."""
    return Resume.model_construct(
        prompt_token_ids=prompt_ids, output_token_ids=output_ids, index=index, text_offset=text_offset
    ).model_dump()
