"""Which adapters the engine knows and which sit in the model's slots: slots are taken on demand
when a request is admitted, held while any request using the adapter is in the engine, and
given to another adapter least-recently-used first once none is.

Reading an adapter from disk happens when it is registered (at start, or through the load route
on the front's thread), never in a step: a step only copies registered weights into a slot."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

from shoal.models.config import ModelConfig
from shoal.models.lora import LoRAAdapter, load_adapter

LORA_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass
class LoRAConfig:
    enable_lora: bool = False
    max_loras: int = 4  # adapters resident in the model at once (its slots)
    max_lora_rank: int = 16
    # name -> folder of a PEFT adapter, registered at start
    lora_modules: dict[str, str] = field(default_factory=dict)
    # What adapter weights are held in (vLLM's --lora-dtype). auto: the model's dtype, but float16
    # over an int4 or int8 base, whose own rounding is far coarser: half the bytes a step reads
    # for rows of distinct adapters (see benchmarks/multi_lora.py).
    lora_dtype: str = "auto"

    def __post_init__(self):
        self.lora_modules = dict(self.lora_modules)  # from flags: (name, path) pairs
        if self.lora_modules and not self.enable_lora:
            self.enable_lora = True  # naming adapters asks for them
        if not 1 <= self.max_loras <= 1023 or not 1 <= self.max_lora_rank <= 512:
            raise ValueError("max_loras must be in 1..1023 and max_lora_rank in 1..512")
        if self.lora_dtype != "auto" and self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be auto or one of {', '.join(LORA_DTYPES)}")

    def weights_dtype(self, model_dtype: torch.dtype, quantized: bool) -> torch.dtype:
        """What the adapter slots hold, for a model of this dtype (quantized or not)."""
        if self.lora_dtype != "auto":
            return LORA_DTYPES[self.lora_dtype]
        return torch.float16 if quantized and model_dtype == torch.float32 else model_dtype


def parse_lora_module(text: str) -> tuple[str, str]:
    """NAME=PATH (vLLM's --lora-modules spelling)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"{text!r}: expected NAME=PATH")
    return name, path


class AdapterInUseError(RuntimeError):
    pass


@dataclass(frozen=True)
class LoRAStats:
    resident: tuple[str, ...]  # adapters in the model's slots
    loads: dict[str, int]  # times each adapter was put in a slot
    evictions: dict[str, int]  # times each was displaced by another
    requests: dict[str, int]  # requests admitted, by adapter
    slots: int  # adapters that fit in the model at once


class LoRAManager:
    def __init__(self, num_slots: int, model_config: ModelConfig, max_rank: int):
        self.num_slots = num_slots
        self.model_config = model_config  # what an adapter must fit
        self.max_rank = max_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slot_of: dict[str, int] = {}  # resident adapters
        self.users: dict[str, int] = {}  # requests in the engine holding each resident adapter
        self.idle: OrderedDict[str, None] = OrderedDict()  # resident, unused; least recent first
        self.free_slots = list(range(num_slots, 0, -1))
        self.pending_loads: list[tuple[int, LoRAAdapter | None]] = []  # for the next step
        self.loads: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()

    def read(self, name: str, path: str) -> LoRAAdapter:
        """An adapter read from disk and checked against the model. It touches no state, so a front
        may call this off the engine's thread and `register` the result there."""
        return load_adapter(name, path, self.model_config, self.max_rank)

    def add(self, name: str, path: str) -> None:
        self.register(self.read(name, path))

    @property
    def names(self) -> list[str]:
        return sorted(self.adapters)

    def register(self, adapter: LoRAAdapter) -> None:
        """Adds an adapter, or replaces an unused one of the same name."""
        if self.users.get(adapter.name):
            raise AdapterInUseError(f"adapter {adapter.name!r} is in use by running requests")
        self._evict(adapter.name)
        self.adapters[adapter.name] = adapter

    def unregister(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(name)
        if self.users.get(name):
            raise AdapterInUseError(f"adapter {name!r} is in use by requests; try again when they end")
        self._evict(name)
        del self.adapters[name]

    def acquire(self, name: str) -> int | None:
        """The adapter's slot for one more request (loading it if it is not resident), or None
        when every slot is held by adapters in use."""
        slot = self.slot_of.get(name)
        if slot is None:
            if not self.free_slots:
                if not self.idle:
                    return None
                victim = next(iter(self.idle))
                self._evict(victim)
                self.evictions[victim] += 1
            slot = self.free_slots.pop()
            self.slot_of[name] = slot
            self.pending_loads.append((slot, self.adapters[name]))
            self.loads[name] += 1
        self.idle.pop(name, None)
        self.users[name] = self.users.get(name, 0) + 1
        self.requests[name] += 1
        return slot

    def release(self, name: str) -> None:
        left = self.users.get(name, 0) - 1
        if left > 0:
            self.users[name] = left
            return
        self.users.pop(name, None)
        if name in self.slot_of:
            self.idle[name] = None  # most recently used last

    def stats(self) -> LoRAStats:
        return LoRAStats(
            tuple(sorted(self.slot_of)),
            dict(self.loads),
            dict(self.evictions),
            dict(self.requests),
            self.num_slots,
        )

    def take_loads(self) -> list[tuple[int, LoRAAdapter | None]]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def _evict(self, name: str) -> None:
        slot = self.slot_of.pop(name, None)
        self.idle.pop(name, None)
        if slot is not None:
            self.free_slots.append(slot)
            # A slot's weights are replaced when it is next taken; empty it now all the same, so
            # that nothing can read an unregistered adapter's weights.
            self.pending_loads.append((slot, None))
