"""The models a fleet serves, as configured: which ids it answers, which it lists, and which wake
from zero when asked for. The gateway's edge, admission and the batch lane read it; the controller
runs the same models' pools."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.fleet.config import FleetConfig, ModelConfig
from shoal.models.checkpoint import resolve_model


def replica_flag(model: ModelConfig, flag: str) -> str | None:
    """The value `model`'s replicas are started with for `flag` (--flag V or --flag=V), if any."""
    args = model.replica_args
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def served_name(model: ModelConfig) -> str | None:
    """The id a replica of `model` answers to: its name, its --served-model-name, or the
    checkpoint's own name (None when the checkpoint cannot be found here)."""
    if model.name:
        return model.name
    if (name := replica_flag(model, "--served-model-name")) is not None:
        return name
    try:
        return resolve_model(model.model)[0]
    except FileNotFoundError:
        return None


@dataclass
class ModelCatalog:
    models: list[ModelConfig] = field(default_factory=list)  # none: a gateway over --backend replicas
    multi_model: bool = False  # requests name their model ([[models]] tables)

    @classmethod
    def of(cls, fleet: FleetConfig) -> ModelCatalog:
        return cls(fleet.model_configs(), bool(fleet.models))

    def serves(self, model) -> bool:
        return not self.multi_model or any(m.name == model for m in self.models)

    def names_a_model(self, name) -> bool:
        """Whether `name` is one of the fleet's own models (so not a LoRA adapter over one)."""
        return self.serves(name) if self.multi_model else name in self.listed()

    def wakes(self, model: str | None) -> bool:
        """Whether a request for `model`, finding no replica, should wait for one to start: its
        pool scales (a fixed pool's replicas come back only by restarting)."""
        for m in self.models:
            if not self.multi_model or m.name == model:
                return m.autoscaled and m.max_replicas > 0
        return False

    @property
    def scalable(self) -> bool:
        """Some model may scale to zero and back: the fleet takes requests with no replica up."""
        return any(m.autoscaled for m in self.models)

    def tool_call_parser(self) -> str | None:
        """The --tool-call-parser of the model whose tokenizer the gateway routes with (the first)."""
        return replica_flag(self.models[0], "--tool-call-parser") if self.models else None

    def listed(self) -> list[str]:
        """The model ids `/v1/models` shows even with no replica up."""
        names = [served_name(m) for m in self.models]
        return [n for n in names if n]
