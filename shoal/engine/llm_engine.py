"""The synchronous text front over the engine core, for callers on one thread (`LLM`, the offline
benchmarks): prompts in as text or token ids, steps out as RequestOutputs with text.

It tokenizes, keeps an OutputProcessor that turns the core's token deltas into text, and tells the
core of the stop strings it finds. The server's front (AsyncEngine) does the same on its event
loop; the core itself never sees text."""

from __future__ import annotations

from shoal.engine.config import EngineConfig
from shoal.engine.core import EngineCore
from shoal.engine.output_processor import OutputProcessor
from shoal.engine.outputs import RequestOutput
from shoal.engine.request import Request
from shoal.engine.request_checks import EngineBrokenError, RequestRejectedError
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.step_result import EngineStats
from shoal.models.loader import LoadedModel

# Where they were before the core moved out; callers import them from here.
__all__ = ["EngineBrokenError", "EngineStats", "LLMEngine", "RequestRejectedError"]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.core = EngineCore(config, loaded)
        self.config = config
        self.tokenizer = self.core.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self._kv_events: list = []  # each step's KV events, kept until someone takes them

    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        prior_output_ids: list[int] | None = None,
        prior_text_sent: int | None = None,
        **options,
    ) -> Request:
        """A resumed request (`prior_output_ids`) streams only its new tokens, with any text of the
        prior ones past `prior_text_sent` characters first. `options` go to EngineCore.add_request
        (priority, arrival time, K/V handoff)."""
        params = params or SamplingParams()
        if request_id in self.output_processor.groups:
            raise RequestRejectedError(f"request id {request_id!r} is already in use", "request_id")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        req = self.core.add_request(request_id, ids, params, prior_output_ids=prior_output_ids, **options)
        self.output_processor.add(request_id, text, ids, params, prior_output_ids, prior_text_sent)
        return req

    def abort_request(self, request_id: str) -> bool:
        self.output_processor.drop(request_id)
        return self.core.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step of the core, with text."""
        result = self.core.step()
        if self.config.cache.enable_kv_events:
            self._kv_events.extend(result.kv_events)
        outputs, stops = self.output_processor.process(result.outputs)
        for request_id, stop in stops:
            self.core.stop_request(request_id, stop)
        return outputs

    def take_kv_events(self) -> list:
        """KV events of the steps run since the last call, and of anything between steps."""
        events, self._kv_events = self._kv_events, []
        return events + self.core.take_kv_events()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.shutdown()
