"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import Any

from shoal.engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from shoal.engine.llm_engine import LLMEngine
from shoal.engine.lora_manager import LoRAConfig
from shoal.engine.outputs import RequestOutput
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.speculative import SpeculativeConfig
from shoal.models.loader import LoadedModel

Conversation = list[dict[str, Any]]


def build_engine_config(model: str | None = None, **options: Any) -> EngineConfig:
    """Spreads flat keyword options (as the CLI gives them) over the nested config dataclasses."""
    kinds = {
        "cache": CacheConfig,
        "scheduler": SchedulerConfig,
        "speculative": SpeculativeConfig,
        "parallel": ParallelConfig,
        "lora": LoRAConfig,
    }
    given: dict[str, dict[str, Any]] = {group: {} for group in kinds}
    top: dict[str, Any] = {"model": model}
    for key, value in options.items():
        for group, kind in kinds.items():
            if key in {f.name for f in fields(kind)}:
                given[group][key] = value
                break
        else:
            if key not in {f.name for f in fields(EngineConfig)}:
                raise TypeError(f"unknown engine option {key!r}")
            top[key] = value
    # Built whole, so that each config's own checks and conversions (__post_init__) run.
    return EngineConfig(**top, **{group: kinds[group](**given[group]) for group in kinds})


class LLM:
    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None, **options: Any):
        self.engine = LLMEngine(build_engine_config(model, **options), loaded=loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the engine's worker processes (a tensor- or pipeline-parallel engine has some)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priorities: Sequence[int] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora`: the adapter every prompt runs with, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        params = (
            sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        )
        order = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(
                rid,
                prompt,
                p or SamplingParams(),
                priority=priorities[i] if priorities else 0,
                lora=loras[i],
            )
            order.append(rid)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in order]

    def embed(
        self, prompts: str | Sequence[str] | Sequence[list[int]], pooling: str = "last"
    ) -> list[list[float]]:
        """Each prompt's final hidden states pooled ("mean" or "last"), L2-normalized."""
        outs = self.generate(prompts, SamplingParams(max_tokens=0, pooling=pooling))
        return [o.embedding for o in outs]

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c, **template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params)

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text as it is generated, for a single prompt."""
        rid = f"llm-{next(self._ids)}"
        self.engine.add_request(rid, prompt, sampling_params or SamplingParams())
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == rid and out.outputs[0].delta_text:
                        yield out.outputs[0].delta_text
        finally:
            self.engine.abort_request(rid)
