"""Runs the model on tensor_parallel_size x pipeline_parallel_size worker processes.

The scheduler stays here, in the driver; each step goes to every rank as one pickled
SchedulerOutput, and the first rank of the last stage answers with the sampled tokens. Every rank
answers each step (an empty reply from most), so a rank that fails or dies is noticed at once,
and one that hangs within `step_timeout_s`. Steps may be submitted ahead of their results (up to
one per pipeline stage): each rank runs its steps in order, and replies come back in order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from multiprocessing.connection import Connection, wait

import torch

from shoal.engine.config import EngineConfig
from shoal.engine.parallel import model_files
from shoal.engine.parallel.auth_listener import AuthListener
from shoal.engine.parallel.messages import RankStats, WorkerSetup, rank_threads
from shoal.engine.parallel.model_files import ModelFiles
from shoal.engine.parallel.rendezvous import StoreServer
from shoal.engine.parallel.worker import AUTHKEY_ENV
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from shoal.kernels.cpu import cpu_kernels
from shoal.models.checkpoint import resolve_model
from shoal.models.loader import LoadedModel
from shoal.models.moe import merge_expert_load
from shoal.models.parallel import check_parallel_sizes

log = logging.getLogger(__name__)


class ExecutorDeadError(RuntimeError):
    """A rank died, hung or lost its peers: the engine cannot go on and must be restarted."""


class RankStepError(RuntimeError):
    """A step raised on a rank that is still well (a request's fault): it may be retried."""


def _busy(thread: threading.Thread | None) -> bool:
    return thread is not None and thread.is_alive()


def _send_quietly(conn: Connection, path) -> None:
    with contextlib.suppress(OSError, EOFError):  # the rank went away: the start loop sees it exit
        model_files.send(conn, path)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MultiprocExecutor:
    # A rank's K/V is only its slice (heads, layers): nothing hands a whole request's over yet.
    moves_kv = False

    def __init__(self, config: EngineConfig, loaded: LoadedModel, num_blocks: int, max_model_len: int):
        par = config.parallel
        check_parallel_sizes(loaded.config, par.tensor_parallel_size, par.pipeline_parallel_size)
        self.config = config
        self.world_size = par.world_size
        self.max_in_flight = par.pipeline_parallel_size  # one step per stage
        self.timeout = par.step_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._in_flight: deque[int] = deque()  # step ids submitted, oldest first
        self.dead: str | None = None
        self._closed = False
        self._exit_fds: list[int] = []
        self.rank_stats: list[RankStats] = [RankStats(r) for r in range(self.world_size)]
        host = par.distributed_host
        port = par.distributed_port or _free_port(host)
        store_port = par.distributed_port + 1 if par.distributed_port else _free_port(host)
        key_hex = os.environ.get(AUTHKEY_ENV) if not par.launch_workers else None
        if not par.launch_workers and not key_hex:
            raise ValueError(f"ranks started elsewhere need {AUTHKEY_ENV} set on the driver and on each rank")
        authkey = bytes.fromhex(key_hex) if key_hex else secrets.token_bytes(32)
        # The driver hosts the rendezvous, behind the same key, so the ranks need only its address.
        self.store: StoreServer | None = None
        try:
            self.store = StoreServer(host, store_port, authkey)
            self.listener = AuthListener(host, port, authkey)
        except OSError as exc:
            if self.store is not None:
                self.store.close()
            raise OSError(
                f"cannot listen for ranks on {host}:{port} and {host}:{store_port} (--distributed-host, "
                f"--distributed-port): {exc.strerror or exc}"
            ) from None
        self.address = f"{host}:{port}"
        try:
            if par.launch_workers:
                self._tune_kernels(rank_threads(config))
                self._spawn(authkey)
            else:
                log.info(
                    "waiting for %d ranks: on each host run `shoal worker --driver %s --rank R` with %s set",
                    self.world_size,
                    self.address,
                    AUTHKEY_ENV,
                )
            self.model_path = resolve_model(config.model)[1]
            model = ModelFiles.of(self.model_path)
            setup = WorkerSetup(config, num_blocks, max_model_len, store_port, uuid.uuid4().hex[:12], model)
            self.ranks_info = self._start(setup, par.startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def _tune_kernels(threads: int) -> None:
        """Measures the kernel crossovers for the ranks' thread count here, on a quiet machine,
        before they start: ranks that measured at once would time each other (two 1-thread ranks
        measured an fp32 tie at 8 rows that way, and sent 8-row steps to the slower path)."""
        kernels = cpu_kernels()
        if kernels is None:
            return
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            kernels.choices  # noqa: B018 - measured and stored on first use
        finally:
            torch.set_num_threads(before)

    def _spawn(self, authkey: bytes) -> None:
        env = {**os.environ, AUTHKEY_ENV: authkey.hex()}
        for rank in range(self.world_size):
            cmd = [sys.executable, "-m", "shoal.engine.parallel.worker", "--driver", self.address]
            proc = subprocess.Popen([*cmd, "--rank", str(rank), "--spawned"], env=env)
            self.procs.append(proc)
            with contextlib.suppress(OSError, AttributeError):  # Linux 5.3+
                self._exit_fds.append(os.pidfd_open(proc.pid))

    def _start(self, setup: WorkerSetup, timeout: float) -> list[dict]:
        """Accepts every rank's connection, sends it the setup and waits until all have loaded."""
        deadline = time.monotonic() + timeout
        by_rank: dict[int, Connection] = {}
        accepted: queue.SimpleQueue = queue.SimpleQueue()
        # accept() blocks; a thread takes the connections so that this one can watch the processes.
        threading.Thread(target=self._accept, args=(accepted,), daemon=True).start()
        while len(by_rank) < self.world_size:
            self._check_started(deadline, f"{len(by_rank)} of {self.world_size} ranks connected")
            try:
                conn, hello = accepted.get(timeout=1.0)
            except queue.Empty:
                continue
            rank = hello[1]
            if hello[0] != "hello" or not 0 <= rank < self.world_size or rank in by_rank:
                conn.close()
                continue
            by_rank[rank] = conn
        self.conns = [by_rank[r] for r in range(self.world_size)]
        self._close_listener()
        for conn in self.conns:
            conn.send(setup)
        info: dict[int, dict] = {}
        sending: dict[int, threading.Thread] = {}  # ranks being sent the model's files
        while len(info) < self.world_size:
            self._check_started(deadline, f"{len(info)} of {self.world_size} ranks loaded")
            quiet = [c for r, c in enumerate(self.conns) if r not in info and not _busy(sending.get(r))]
            for conn in wait(quiet, timeout=1.0):
                rank = self.conns.index(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    raise ExecutorDeadError(f"rank {rank} exited while starting") from None
                if msg[0] == "fetch":  # its host lacks the model: stream it, off this loop
                    log.info("sending rank %d the model's files (%s)", rank, self.model_path)
                    sending[rank] = threading.Thread(target=_send_quietly, args=(conn, self.model_path))
                    sending[rank].start()
                    continue
                if msg[0] != "ready":
                    raise ExecutorDeadError(msg[1])
                info[msg[1]["rank"]] = msg[1]
        log.info("%d ranks ready: %s", self.world_size, [info[r] for r in sorted(info)])
        return [info[r] for r in sorted(info)]

    def _accept(self, accepted: queue.SimpleQueue) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:  # the listener closed (all connected, or given up)
                return
            try:
                accepted.put((conn, conn.recv()))
            except Exception:  # a peer with the key that sent nothing sensible: ignore it
                conn.close()

    def _check_started(self, deadline: float, progress: str) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise ExecutorDeadError(f"rank {rank} exited with {proc.returncode} while starting")
        if time.monotonic() > deadline:
            raise ExecutorDeadError(f"the ranks did not start in time ({progress})")

    # --- steps ---------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(so)
        return self.collect()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def submit(self, so: SchedulerOutput) -> None:
        self._check_alive()
        data = pickle.dumps(("step", so), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as exc:
            self._fail(f"a rank's connection broke: {exc}")
        self._in_flight.append(so.step_id)

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's result."""
        self._in_flight.popleft()
        deadline = time.monotonic() + self.timeout
        replies: dict[int, tuple] = {}
        while len(replies) < self.world_size:
            left = deadline - time.monotonic()
            waiting = [c for r, c in enumerate(self.conns) if r not in replies]
            # A pidfd becomes readable when its process exits: a dead rank wakes this at once.
            ready = wait(waiting + self._exit_fds, timeout=max(0.0, left))
            if not ready:
                late = [r for r in range(self.world_size) if r not in replies]
                self._fail(f"ranks {late} did not finish a step within {self.timeout:g} s")
            for obj in ready:
                if not isinstance(obj, Connection):
                    self._check_alive()
                    continue
                rank = self.conns.index(obj)
                try:
                    replies[rank] = obj.recv()
                except (EOFError, OSError):
                    self._fail(f"rank {rank} went away mid-step")
        fatal = [(r, m[1]) for r, m in replies.items() if m[0] == "fatal"]
        if fatal:
            self._fail(f"rank {fatal[0][0]}: {fatal[0][1]}")
        for rank, msg in replies.items():
            if msg[0] == "ok":
                self.rank_stats[rank] = msg[2]
        errors = [(r, m[1]) for r, m in sorted(replies.items()) if m[0] == "error"]
        if errors:
            raise RankStepError(errors[0][1])
        out = next((m[1] for m in replies.values() if m[1] is not None), None)
        return out if out is not None else ModelRunnerOutput()

    def export_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        raise NotImplementedError("a parallel engine cannot hand its K/V to another yet")

    def export_blocks(self, sources: list[tuple[str, int]]) -> torch.Tensor:
        raise NotImplementedError("a parallel engine cannot hand its K/V to another yet")

    def tier_costs(self) -> dict[str, float] | None:
        return None  # each rank's store would time its own shard: the ranks load always

    def expert_load(self) -> dict[int, list[int]] | None:
        return merge_expert_load([s.expert_tokens for s in self.rank_stats])

    # --- health and shutdown -------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead:
            raise ExecutorDeadError(self.dead)
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                self._fail(f"rank {rank} exited with {proc.returncode}")

    def check_health(self) -> None:
        """Raises ExecutorDeadError if a rank has died since the last step (between steps too)."""
        self._check_alive()
        if not self._in_flight:
            for rank, conn in enumerate(self.conns):
                with contextlib.suppress(OSError):
                    if conn.poll():  # between steps a rank only speaks by closing its connection
                        self._fail(f"rank {rank} closed its connection")

    def _fail(self, reason: str) -> None:
        log.error("parallel executor down: %s", reason)
        self.dead = reason
        self._stop_ranks(graceful=False)
        raise ExecutorDeadError(reason)

    def _stop_ranks(self, graceful: bool) -> None:
        if graceful:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(pickle.dumps(("shutdown",)))
            deadline = time.monotonic() + 5
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        for conn in self.conns:
            conn.close()
        self.conns = []
        for fd in self._exit_fds:
            os.close(fd)
        self._exit_fds = []

    def _close_listener(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):
            self.listener.close()

    def shutdown(self) -> None:
        self._stop_ranks(graceful=not self.dead)
        self._close_listener()
        if self.store is not None:
            self.store.close()
