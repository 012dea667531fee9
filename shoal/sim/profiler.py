"""`shoal profile`: runs the real engine through steps of known shapes (decode batches over several
context lengths, prompts of several lengths, prompts arriving into running batches), times each
step as the engine loop runs it, and fits the step cost models of a NodeProfile."""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np

from shoal import __version__
from shoal.engine.step_shape import StepShape
from shoal.engine.step_trace import STEP_TRACE_ENV, read_steps, step_trace_files
from shoal.sim.fleet import FleetShape, FleetSim
from shoal.sim.kv_handoff import time_handoff_cpu, time_kv_transfer
from shoal.sim.profile import DECODE_FEATURES, MIXED_FEATURES, NodeProfile, StepCost
from shoal.sim.replica import ReplicaShape
from shoal.sim.servers import ProcessCPU, running
from shoal.sim.speed_probe import STEP_KINDS, host_speed, price_probe, served_ratios
from shoal.sim.startup_timing import time_startup
from shoal.sim.step_samples import StepRecorder, merge_decode_runs, write_samples
from shoal.sim.workload import Lengths, WorkloadSpec

MIN_KEPT = 0.5  # a server calibration keeps at least this part of each step cost it corrects
MAX_PROMPT_SCALE = 3.0  # nor makes a prompt's tokens cost more than this many times the bare ones
# ... nor less than the bare ones: a served prompt computes what a bare one does, and its front
# tokenizes it on the same cores. A factor under one is this machine's speed drifting between the
# bare steps and the served ones: calibrations here found x0.89 and x0.96, where the P/D row's
# prefill worker then ran its steps of one to three 512-token prompts within 1 % of the bare ones.
MIN_PROMPT_SCALE = 1.0
LONG_PROMPT_TIMES = 4  # the calibration's second prompt length, in multiples of its first
LONG_PROMPT_SEED = 1000  # its prompts' seed: apart from the seeds of the runs by batch size
# ... priced only where the bare engine's long prompt costs at least this part more than its short
# one: on a GPU both cost about the launches of a step, and their difference is noise.
MIN_PROMPT_SPREAD = 0.25
# The gateway's CPU with nothing to relay is timed over this long once it is up (its polls of its
# replica): the front's price a token is what it takes beyond that.
GATEWAY_IDLE_S = 3.0


def calibration_requests(clients: int) -> int:
    """Requests in a serving calibration run of `clients` at a time: at least eight, so that even
    the one-client run averages its inter-token time over several seconds of this machine's
    drifting speed (two requests swung the fitted serving cost by a millisecond a row)."""
    return max(2 * clients, 8)


@dataclass
class ProfileConfig:
    engine_options: dict = field(default_factory=dict)  # as `shoal serve` takes them (LLM(**options))
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    contexts: tuple[int, ...] = (32, 512, 1536)
    prompt_lengths: tuple[int, ...] = (32, 128, 512, 1024, 2048)
    # Prompts arriving together, this many at once (up to 512 tokens each, within the token budget).
    prompt_groups: tuple[int, ...] = (2, 4)
    decode_steps: int = 10  # decode steps timed per batch
    repeats: int = 2  # each scenario run this often (the median of noisy steps is what the fit sees)
    startup: bool = True  # time a replica's start in a fresh process (startup_timing.py)
    # `shoal serve` flags for the same engine: when given, a server is started with them and the
    # profile is calibrated to what serving adds to each step (streams, HTTP) and to each request.
    serve_flags: list[str] | None = None
    # Calibrate through a gateway (`shoal fleet up --replicas 1`) rather than a bare server: on a
    # machine where the gateway shares the replicas' cores, its relaying is part of every step.
    through_gateway: bool = False
    serve_batches: tuple[int, ...] = (1, 4, 16)
    # With serve_flags: time a K/V handoff by its size, from a prefill worker of the same engine
    # to a puller, over shared memory and over TCP (prompts of these lengths, each thrice).
    kv_transfer_lengths: tuple[int, ...] = (64, 256, 1024)
    seed: int = 0
    # Price the speed probe (speed_probe.py) by the fitted steps, and probe the host before the
    # serving calibration (its runs are then set against the bare steps at the host's speed then).
    speed_probe: bool = True
    # Where to save the profile after each stage, so a stage that fails (a server that does not
    # start, a lease that ends) leaves the stages before it on disk.
    save_to: str | None = None
    # Where to write every timed step (its shape and seconds, a JSON object a line): a profile can
    # then be fitted again off the machine it was taken on, as a GPU lease's must be.
    samples_to: str | None = None


def run_scenarios(
    rec: StepRecorder, cfg: ProfileConfig, max_seqs: int, kv_tokens: int, max_len: int, budget: int
) -> None:
    # Warm the kernels and allocator before anything is timed.
    rec.add(64, 4)
    rec.run(record=False)
    for _ in range(cfg.repeats):
        for ctx in cfg.contexts:
            for b in cfg.decode_batches:
                if (
                    b > max_seqs
                    or ctx + cfg.decode_steps >= max_len
                    or b * (ctx + cfg.decode_steps) > 0.8 * kv_tokens
                ):
                    continue
                for _ in range(b):
                    rec.add(ctx, cfg.decode_steps)
                rec.run()
        for n in cfg.prompt_lengths:
            if n < max_len:
                rec.add(n, 1)
                rec.run()
        # Several prompts in one step: what a burst, or a prefill worker, runs.
        for b in cfg.prompt_groups:
            n = min(512, budget // b, max_len - 8)
            if b <= max_seqs and b * n <= 0.8 * kv_tokens:
                for _ in range(b):
                    rec.add(n, 1)
                rec.run()
        # Prompts arriving into a running batch: the mixed steps a server sees all day.
        for b in (4, 16):
            if b > max_seqs - 3:
                continue
            for _ in range(b):
                rec.add(256, 16)
            rec.run(inject={2: [64], 5: [512], 9: [min(1024, max_len - 8)]})


def measure(cfg: ProfileConfig) -> NodeProfile:
    from shoal.kernels.build import cpu_model_name
    from shoal.llm import LLM

    llm = LLM(**cfg.engine_options)
    try:
        engine = llm.engine
        core, ec = engine.core, engine.config
        kv = core.scheduler.kv
        rec = StepRecorder(engine, cfg.seed)
        run_scenarios(
            rec,
            cfg,
            ec.scheduler.max_num_seqs,
            kv.pool.num_blocks * kv.block_size,
            engine.max_model_len,
            ec.scheduler.max_num_batched_tokens,
        )
        if cfg.samples_to:
            write_samples(rec.samples, cfg.samples_to)
        # The handoffs' CPU, on this engine while it is up (their time to arrive needs a server).
        handoff_cpu = time_handoff_cpu(engine, cfg.kv_transfer_lengths, cfg.seed)
        decode = [(s, t) for s, t in merge_decode_runs(rec.samples) if s.decode_only]
        mixed = [(s, t) for s, t in rec.samples if not s.decode_only]
        machine = cpu_model_name()
        if ec.device.startswith("cuda"):
            import torch

            machine = torch.cuda.get_device_name()
        profile = NodeProfile(
            machine=machine,
            device=ec.device,
            shoal_version=__version__,
            model=engine.model_name,
            quantization=ec.quantization,
            tensor_parallel=ec.parallel.tensor_parallel_size,
            pipeline_parallel=ec.parallel.pipeline_parallel_size,
            num_threads=ec.num_threads,
            block_size=kv.block_size,
            num_kv_blocks=kv.pool.num_blocks,
            max_model_len=engine.max_model_len,
            max_num_seqs=ec.scheduler.max_num_seqs,
            max_num_batched_tokens=ec.scheduler.max_num_batched_tokens,
            decode=StepCost.fit(
                DECODE_FEATURES,
                [s for s, _ in decode],
                [t for _, t in decode],
                # The batches it ran, not every row count a mixed scenario passed through: a
                # knot seen in a few steps only would fit their noise.
                knots=sorted({b for b in cfg.decode_batches if b <= ec.scheduler.max_num_seqs}),
            ),
            mixed=StepCost.fit(MIXED_FEATURES, [s for s, _ in mixed], [t for _, t in mixed]),
            kv_transfer=handoff_cpu,
            measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        if cfg.speed_probe:
            profile.probe_s, profile.probe_timed_s = price_probe(profile, engine)
    finally:
        llm.shutdown()
    _save(profile, cfg)
    if cfg.serve_flags is not None:
        # The served runs against the bare steps at the host's speed when they run.
        calibrate_to_server(profile, cfg, host_speed(profile, cfg.engine_options) if cfg.speed_probe else 1.0)
        _save(profile, cfg)
        if cfg.kv_transfer_lengths:
            lengths, max_len = cfg.kv_transfer_lengths, profile.max_model_len
            from shoal.fleet.control.cores import host_cpus

            # On a CPU, the server's CPU beyond its steps (a GPU's forward passes are not CPU).
            threads = (profile.num_threads or len(host_cpus())) if profile.device == "cpu" else None
            packing = profile.kv_transfer.get("prefill_cpu_s_per_mib", 0.0)
            arrival = time_kv_transfer(cfg.serve_flags, lengths, max_len, cfg.seed, threads, packing)
            profile.kv_transfer = {**profile.kv_transfer, **arrival}
            _save(profile, cfg)
    if cfg.startup:
        profile.startup_s = time_startup(cfg.serve_flags, cfg.engine_options)
        _save(profile, cfg)
    return profile


def _save(profile: NodeProfile, cfg: ProfileConfig) -> None:
    if cfg.save_to:
        profile.save(cfg.save_to)


def calibrate_to_server(profile: NodeProfile, cfg: ProfileConfig, speed: float = 1.0) -> None:
    """Streams batches of requests through a real `shoal serve` of the same engine (or a gateway
    in front of one) and compares their inter-token times with the same runs simulated from the
    bare profile (fold_serving): the difference, per step and per row, is what serving adds
    (streaming each token to its client, the HTTP front); the time to a single request's first
    token beyond its prefill step is what each request adds."""
    from shoal.bench.serve import ServeBenchConfig, run_serve_bench

    if cfg.through_gateway:
        command = ["fleet", "up", "--replicas", "1", "--replica-args", " ".join(cfg.serve_flags)]
    else:
        command = ["serve", *cfg.serve_flags]
    trace = tempfile.TemporaryDirectory(prefix="shoal-profile-steps-")
    with trace, running(command, env={STEP_TRACE_ENV: trace.name}) as (url, proc):
        front = FrontCPU(proc.pid) if cfg.through_gateway else None
        idle_cores = front.idle_cores(GATEWAY_IDLE_S) if front is not None else 0.0
        prompt, steps = 128, 48
        measured = []

        def run(clients: int, requests: int, prompt_len: int, output_len: int, seed: int = 0) -> dict:
            bench = ServeBenchConfig(
                base_url=url,
                num_requests=requests,
                input_len=prompt_len,
                output_len=output_len,
                max_concurrency=clients,
                seed=seed or clients,
                tokenizer=cfg.engine_options.get("model"),  # the profiled model's, not the bundled one's
            )
            with contextlib.redirect_stdout(io.StringIO()):  # its report is not the profile's
                return run_serve_bench(bench)

        for b in cfg.serve_batches:
            if b <= profile.max_num_seqs:
                measured.append((b, run(b, calibration_requests(b), prompt, steps)))
        # For the tokens above, over front_s seconds.
        front_cpu_s, front_s = (front.seconds(), front.elapsed()) if front is not None else (None, 0.0)
        # Lone prompts of a second length, beside the lone prompts of the one-client run above,
        # each prefilled in one step (within the token budget), none sharing a prefix with those,
        # and no longer than the bare prompts timed (a fit stretched past them prices nothing).
        longest = min(max(cfg.prompt_lengths, default=prompt), profile.max_num_batched_tokens)
        long_len = min(LONG_PROMPT_TIMES * prompt, longest, profile.max_model_len - 8)
        long_prompt = (long_len, run(1, 4, long_len, 2, seed=LONG_PROMPT_SEED)) if long_len > prompt else None
        fold_serving(profile, measured, prompt, steps, long_prompt, speed)
        # The served steps against the folded costs, at the fit's speed: how far serving's own
        # work (streams, HTTP) beside a step stretched it, by kind, as the profile describes it.
        served = [step for path in step_trace_files(trace.name) for step in read_steps(path)]
        ratios = served_ratios(profile, served)
        if not ratios:
            raise RuntimeError("the calibration's server traced no steps")
        for kind in STEP_KINDS:  # a kind the runs lacked: as the other
            profile.serving[f"{kind}_step_ratio"] = ratios.get(kind, next(iter(ratios.values()))) / speed
    if front_cpu_s is not None:
        from shoal.fleet.control.cores import host_cpus

        streamed = max(1, sum(s["total_output_tokens"] for _, s in measured))
        # The gateway's alone: what a fleet's gateways cost (the planner sizes them by it).
        profile.serving["gateway_cpu_s_per_token"] = front_cpu_s / streamed
        # The gateway's beyond its idle polls, and the clients' while they sent and read (`shoal
        # bench serve`'s own).
        front_cpu_s += sum(s["client_cpu_s"] for _, s in measured) - idle_cores * front_s
        profile.serving["front_cpu_s_per_token"] = max(0.0, front_cpu_s) / streamed
        profile.serving["gateway_idle_cpu_s_per_s"] = idle_cores
        profile.serving["cores"] = len(host_cpus())


class FrontCPU:
    """CPU seconds a gateway's process spends from now (not its replicas', its children)."""

    def __init__(self, gateway_pid: int):
        self.cpu = ProcessCPU(gateway_pid, "the calibration's gateway")
        self.start, self.t0 = self.cpu.seconds(), time.perf_counter()

    def seconds(self) -> float:
        return self.cpu.seconds() - self.start

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def idle_cores(self, seconds: float) -> float:
        """Its CPU a second over the next `seconds`, sent nothing; then it counts from there."""
        time.sleep(seconds)
        idle = self.seconds() / self.elapsed()
        self.start, self.t0 = self.cpu.seconds(), time.perf_counter()
        return idle


def fold_serving(
    profile: NodeProfile,
    measured: list[tuple[int, dict]],
    prompt: int,
    steps: int,
    long_prompt: tuple[int, dict] | None = None,
    speed: float = 1.0,
) -> None:
    """Folds what serving adds into `profile`, from `shoal bench serve` summaries of runs of
    calibration_requests(b) requests (`prompt` tokens in, `steps` out), b at a time: [(b, summary)],
    b ascending; and `long_prompt`: (its length, a run of lone prompts that long), priced against
    the one-client run's prompts (without a one-client run, served prompts keep the bare price).
    `speed`: how many times as slow as the bare steps were timed the host ran the served ones (a
    speed probe right before them): they are set against the bare steps at that speed, so that the
    host drifting between the two is not taken for serving, and folded in at the bare steps' speed."""
    at = profile.at_speed(speed)
    _fold_serving(at, measured, prompt, steps, long_prompt)
    back = at.at_speed(1 / speed)
    profile.decode, profile.mixed = back.decode, back.mixed
    added = {k: at.serving[k] / speed for k in ("per_step_s", "per_row_s")}
    profile.serving = {**at.serving, **added, "speed": speed}


def _fold_serving(
    profile: NodeProfile,
    measured: list[tuple[int, dict]],
    prompt: int,
    steps: int,
    long_prompt: tuple[int, dict] | None,
) -> None:
    scale = 1.0
    if long_prompt is not None and measured[0][0] == 1:
        scale = _prompt_scale(profile, (prompt, measured[0][1]), long_prompt)
        profile.mixed.coef[2] *= scale  # the prompt's tokens
        profile.mixed.coef[3:] = [c * scale for c in profile.mixed.coef[3:]]  # its attention and size
    rows = np.array([b for b, _ in measured], dtype=float)
    # Each run's mean inter-token time against the same run simulated from the bare profile: the
    # simulation has the gaps a new prompt's prefill puts between the others' tokens, so what is
    # left is what serving adds. The mean, not the median: a simulated step costs the same each
    # time, so its cost must be the average for a run's length (throughput, replica-seconds) to
    # come out right; a loaded machine's steps are skewed (stalls), the median prices quiet ones.
    extra = np.array([s["itl_s"]["mean"] - _simulated_itl(profile, b, prompt, steps) for b, s in measured])
    # What serving adds may be negative, and is at large batches here: the server processes a
    # step's output while the next step runs, where the profile's bare loop waits for it. So the
    # line is not clipped at zero; only each corrected cost is kept to a part of its own.
    step_s, row_s = np.polyfit(rows, extra, 1)[::-1] if len(rows) > 1 else (extra[0], 0.0)
    decode, mixed = profile.decode, profile.mixed
    if decode.knots:
        per_knot = (_corrected(c, step_s + row_s * k) for c, k in zip(decode.coef, decode.knots))
        decode.coef = [*per_knot, decode.coef[-1]]
    else:  # a line: step, rows, context
        decode.coef = [_corrected(decode.coef[0], step_s), _corrected(decode.coef[1], row_s), decode.coef[2]]
    mixed.coef[0] = _corrected(mixed.coef[0], step_s)
    mixed.coef[1] = _corrected(mixed.coef[1], row_s)
    first = measured[0][1]["ttft_s"]["p50"] - profile.step_seconds(_lone_prompt(prompt))
    profile.serving = {
        "per_step_s": float(step_s),
        "per_row_s": float(row_s),
        "per_request_s": max(0.0, first),
        "prompt_scale": scale,
    }


def _lone_prompt(tokens: int) -> StepShape:
    one = StepShape()
    one.add_row(tokens, 0)
    return one


def _prompt_scale(profile: NodeProfile, short: tuple[int, dict], long: tuple[int, dict]) -> float:
    """What a served prompt's prefill costs against the bare profile's, for each token it adds: the
    first tokens of lone prompts of two lengths, apart by more than the bare steps are (1; no
    evidence either way: bare steps that barely differ, or runs that did not answer in order).
    A constant per request, all the calibration had before, priced every longer prompt, and every
    batch of them, at the bare engine's rate (this machine's servers came out 0.96 to 1.12 x)."""
    short_s = profile.step_seconds(_lone_prompt(short[0]))
    bare = profile.step_seconds(_lone_prompt(long[0])) - short_s
    firsts = long[1]["ttft_s"]["p50"], short[1]["ttft_s"]["p50"]
    if bare <= MIN_PROMPT_SPREAD * short_s or None in firsts or firsts[0] <= firsts[1]:
        return 1.0
    return float(np.clip((firsts[0] - firsts[1]) / bare, MIN_PROMPT_SCALE, MAX_PROMPT_SCALE))


def _corrected(cost: float, added: float) -> float:
    return max(MIN_KEPT * cost, cost + added)


def _simulated_itl(profile: NodeProfile, clients: int, prompt: int, steps: int) -> float:
    """The mean inter-token time the simulator gives a calibration run (`clients` at a time), from
    `profile` as it stands."""
    spec = WorkloadSpec(
        calibration_requests(clients), input_len=Lengths("fixed", prompt), output_len=Lengths("fixed", steps)
    )
    replica = ReplicaShape(profile.max_num_seqs, profile.max_num_batched_tokens, 0.0)
    run = FleetSim(profile, FleetShape(1, replica=replica, max_concurrency=clients)).run(spec.requests())
    return run.summary()["itl_s"]["mean"]
