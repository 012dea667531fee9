"""Engine configuration: cache, scheduler and top-level engine options."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.engine.lora_manager import LoRAConfig
from shoal.engine.speculative import SpeculativeConfig
from shoal.protocol.bounds import check_bounds
from shoal.protocol.sizes import parse_size

GiB = 1 << 30


@dataclass
class CacheConfig:
    block_size: int = 16
    # The KV pool is sized from this budget (bytes); num_blocks overrides it when set.
    kv_cache_memory: int = 2 * GiB
    num_blocks: int | None = None
    # "auto": the model's dtype; "float16" or "bfloat16" halve the bytes attention reads and double
    # the tokens the pool holds, for a rounding of each key and value.
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False
    # Secret root of the block-hash chains (see shoal.protocol.block_hash.root_hash).
    hash_salt: bytes = b""
    # Offload tiers below the pool (engine.kv_tiers): evicted prefix blocks kept in this many bytes
    # of host memory, then in a folder on local disk up to a size ((PATH, SIZE), as typed).
    kv_offload_memory: int = 0
    kv_offload_disk: tuple[str, ...] = ()

    def __post_init__(self):
        # Sizes may be given as the CLI takes them ("256MiB"), e.g. to LLM(kv_cache_memory=...).
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if isinstance(self.kv_offload_memory, str):
            self.kv_offload_memory = parse_size(self.kv_offload_memory)
        self.kv_offload_disk = tuple(self.kv_offload_disk)
        if self.kv_offload_disk:
            if len(self.kv_offload_disk) != 2:
                raise ValueError("kv_offload_disk is (PATH, SIZE)")
            parse_size(self.kv_offload_disk[1])  # refused now, not at the first eviction
        check_bounds(self, {"block_size": 1, "kv_cache_memory": 1, "num_blocks": 1, "kv_offload_memory": 0})

    @property
    def offload_disk_path(self) -> str | None:
        return self.kv_offload_disk[0] if self.kv_offload_disk else None

    @property
    def offload_disk_bytes(self) -> int:
        return parse_size(self.kv_offload_disk[1]) if self.kv_offload_disk else 0


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    # None: the model's context length, clamped to what the KV pool can hold.
    max_model_len: int | None = None
    # Fraction of blocks kept free when admitting new requests, so decodes do not preempt at once.
    admission_watermark: float = 0.01

    def __post_init__(self):
        least = {"max_num_seqs": 1, "max_num_batched_tokens": 1, "max_model_len": 1, "admission_watermark": 0}
        # A watermark keeping most of the pool free would admit next to nothing.
        check_bounds(self, least, most={"admission_watermark": 0.5})


EXPERT_DISPATCH = ("all-reduce", "all-to-all")


@dataclass
class ParallelConfig:
    """One model across tensor_parallel_size x pipeline_parallel_size worker processes."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # A mixture-of-experts model's experts split whole across the tensor-parallel ranks (its
    # attention by heads): given alone it sets that many ranks; with -tp it must be the same.
    expert_parallel_size: int = 1
    # How tokens reach the ranks of their experts: "all-reduce" (every rank routes every token,
    # the layer's all-reduce combines) or "all-to-all" (each rank routes its share of the tokens
    # and trades them with the experts' ranks: models/moe_dispatch.py).
    expert_dispatch: str = "all-reduce"
    # Expert load balancing: each rank may hold this many replicas of other ranks' experts per
    # layer (0: none), placed anew when a window of this many steps found the ranks' loads uneven.
    expert_spare_slots: int = 0
    expert_rebalance_steps: int = 128
    # Where the driver (the engine's process) waits for its ranks: their connections on `port`
    # and torch.distributed's rendezvous on `port + 1`; 0 picks free ports (ranks on this host).
    distributed_host: str = "127.0.0.1"
    distributed_port: int = 0
    # False: the driver starts no ranks; each is started on its host with `shoal worker` and
    # connects (SHOAL_WORKER_AUTHKEY must be the same on both sides).
    launch_workers: bool = True
    # A rank that does not answer a step (or a collective) within this is taken as dead.
    step_timeout_s: float = 60.0
    startup_timeout_s: float = 300.0

    def __post_init__(self):
        sizes = (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "expert_parallel_size",
            "expert_rebalance_steps",
        )
        check_bounds(
            self,
            {**dict.fromkeys(sizes, 1), "expert_spare_slots": 0, "distributed_port": 0},
            above={"step_timeout_s": 0, "startup_timeout_s": 0},
            most={"distributed_port": 65534},  # the rendezvous takes the next port
        )
        if self.expert_dispatch not in EXPERT_DISPATCH:
            choices = ", ".join(EXPERT_DISPATCH)
            raise ValueError(f"expert_dispatch must be one of {choices}, not {self.expert_dispatch!r}")
        ep, tp = self.expert_parallel_size, self.tensor_parallel_size
        if self.expert_dispatch == "all-to-all" and ep < 2:
            raise ValueError(
                "--expert-dispatch all-to-all trades tokens between expert-parallel ranks: "
                "it needs --expert-parallel-size 2 or more"
            )
        if ep > 1 and tp == 1:
            self.tensor_parallel_size = ep
        elif ep > 1 and ep != tp:
            raise ValueError(
                f"expert parallelism runs over the tensor-parallel ranks: --expert-parallel-size {ep} "
                f"needs --tensor-parallel-size {ep} (or none)"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


DECODE_AHEAD = ("auto", "on", "off")


@dataclass
class EngineConfig:
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    # "auto" (a GGUF as stored), "none" (the fp32 reference), "int8" or "int4": see shoal.models.quant
    quantization: str | None = "auto"
    seed: int = 0
    # CUDA only: run decode steps eagerly instead of replaying captured CUDA graphs.
    enforce_eager: bool = False
    # Queue each greedy decode step's successor before its tokens are read, so the host's work
    # between steps overlaps the device's (engine.decode_ahead): "auto" where CUDA graphs run.
    decode_ahead: str = "auto"
    num_threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        check_bounds(self, {"num_threads": 1})
        if self.decode_ahead not in DECODE_AHEAD:
            raise ValueError(f"decode_ahead is auto, on or off, not {self.decode_ahead!r}")
